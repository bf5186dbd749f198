"""What the 8-bit recipe tests and the `device_mxfp8` tier tests share: tolerances, a relative
error that allows an all-zero reference, routing-like splits, small random MLP inputs, and a
float64 stand-in for torch._scaled_grouped_mm (the CPU and GPU Hopper tests both use it)."""

import torch

# Relative Frobenius error of a whole MLP (outputs and gradients) against unquantised fp32:
# one E4M3 rounding is ~3% rms on Gaussian data, a GEMM of two quantised operands ~4%, and
# the MLP's chained GEMMs land at about half of these bounds (the errors measured, on the CPU
# and on an H100: docs/results/2026-11-21-checks-behind-tolerances.md). About twice the
# measured error leaves room for other random draws; a wrong index or an unwritten expert
# gives errors near 1.
MXFP8_MLP_RTOL = 0.15
FP8_ROWWISE_MLP_RTOL = 0.12
# The same quantised operands, multiplied in float32 (accumulation order only).
FP32_RTOL = 1e-5


def rel_err(a, b) -> float:
    """||a - b|| / ||b||, and 0 where both are zero (an expert with no rows)."""
    diff, ref = (a.double() - b.double()).norm().item(), b.double().norm().item()
    return diff / ref if ref else diff


def random_splits(num_experts, max_rows, generator):
    """Token counts with at least one empty expert, as routing produces."""
    counts = torch.randint(0, max_rows, (num_experts,), generator=generator)
    counts[torch.randint(0, num_experts, (1,), generator=generator)] = 0
    return counts


def group_bounds(offsets):
    """(start, end) rows of each group, from the int32 end offsets the grouped GEMMs take."""
    ends = offsets.tolist()
    return list(zip([0] + ends[:-1], ends))


def mlp_inputs(gen, num_experts=4, d=64, f=96, max_rows=50):
    """x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF: fresh CPU leaves, weights scaled by 1/sqrt(fan-in)."""
    counts = random_splits(num_experts, max_rows, gen)
    x_RD = torch.randn(int(counts.sum()), d, generator=gen, requires_grad=True)
    gate_up = (torch.randn(num_experts, 2 * f, d, generator=gen) / d**0.5).requires_grad_()
    down = (torch.randn(num_experts, d, f, generator=gen) / f**0.5).requires_grad_()
    return x_RD, counts, gate_up, down


def scaled_grouped_mm_stand_in(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """What `torch._scaled_grouped_mm` computes with rowwise scales (PyTorch 2.11, CUDA), in
    float64 on the CPU, with the layout checks its CUDA kernel makes. float32 operands and
    output are let through for the tests that run the FP8 data flow with unrounded values."""
    assert mat_a.dtype == mat_b.dtype and mat_a.dtype in (torch.float8_e4m3fn, torch.float32)
    assert scale_a.dtype == scale_b.dtype == torch.float32 and out_dtype in (torch.bfloat16, torch.float32)
    assert mat_a.stride(-1) == 1, "mat_a must be row-major"
    assert mat_b.stride(-2) == 1, "mat_b must be column-major"
    assert mat_a.shape[-1] % 16 == 0 and mat_b.shape[-2] % 16 == 0 and mat_b.shape[-1] % 16 == 0
    assert offs.dtype == torch.int32
    a, b, groups = mat_a.double(), mat_b.double(), group_bounds(offs)
    if mat_b.dim() == 3:  # 2-D x 3-D: groups of A's rows
        assert scale_a.shape == (a.shape[0],) and scale_b.shape == (b.shape[0], b.shape[2])
        out = a.new_zeros(a.shape[0], b.shape[2])
        for g, (start, end) in enumerate(groups):
            out[start:end] = a[start:end] @ b[g] * scale_a[start:end, None] * scale_b[g]
    else:  # 2-D x 2-D: groups along the reduction dim, scales group-major
        m, n = a.shape[0], b.shape[1]
        assert scale_a.shape == (len(groups) * m,) and scale_b.shape == (len(groups) * n,)
        out = a.new_zeros(len(groups), m, n)
        for g, (start, end) in enumerate(groups):
            assert end - start > 0 and (end - start) % 16 == 0  # a device-side assert on CUDA
            out[g] = a[:, start:end] @ b[start:end] * scale_a[g * m:(g + 1) * m, None] * scale_b[g * n:(g + 1) * n]
    return out.to(out_dtype)
