"""The `device_mxfp8` tier on the CPU: the emulated tier against float64 and fp32, no rows at
all, no host synchronisation in what it issues (both CPU-runnable recipes), and how it picks
its mode.

Shape suffixes: see te_mixtral/__init__.py (its GEMM letters: Q padded rows).
"""

import re

import pytest
import torch
from host_syncs import SYNCHRONISING_OPS, OpRecorder
from quant_reference import MXFP8_MLP_RTOL, group_bounds, mlp_inputs, rel_err

from te_mixtral.config import load_config, load_run_config
from te_mixtral.errors import TierUnavailable, UserError
from te_mixtral.experts.base import swiglu
from te_mixtral.experts.device_mxfp8 import DeviceMXFP8Tier, runs_fp8, select_mode
from te_mixtral.experts.loop import LoopTier
from te_mixtral.experts.quant.fp8_hopper import FP8HopperGemms
from te_mixtral.experts.quant.mxfp8 import fake_quantize
from te_mixtral.experts.quant.padding import pad_rows, padded_rows, unpad_rows
from te_mixtral.experts.quant.scaled_grouped import scaled_grouped_swiglu
from te_mixtral.experts.registry import make_tier


def test_emulated_tier_forward_matches_float64_on_the_quantised_operands():
    gen = torch.Generator().manual_seed(3)
    x_RD, counts, gate_up, down = mlp_inputs(gen)
    tier = DeviceMXFP8Tier("mxfp8-emulated")
    y_RD = tier(x_RD, counts, gate_up, down)

    padded = padded_rows(counts, x_RD.shape[0], align=32)
    x_QD = fake_quantize(pad_rows(x_RD, padded)).double()
    gate_up_q, down_q = fake_quantize(gate_up).double(), fake_quantize(down).double()
    expected = torch.zeros(padded.rows_Q, x_RD.shape[1], dtype=torch.float64)
    for e, (start, end) in enumerate(group_bounds(padded.offsets_L)):
        h = swiglu(x_QD[start:end] @ gate_up_q[e].T)
        expected[start:end] = fake_quantize(h.float()).double() @ down_q[e].T
    # fp32 vs float64 h can land an element of h on the other side of an E4M3 rounding
    # boundary, now and then: far below the MXFP8 error itself.
    assert rel_err(y_RD, unpad_rows(expected, padded)) < 1e-4


@pytest.mark.parametrize("seed", [4, 5])
def test_emulated_tier_forward_and_backward_close_to_fp32(seed):
    gen = torch.Generator().manual_seed(seed)
    inputs = mlp_inputs(gen)
    y = DeviceMXFP8Tier("mxfp8-emulated")(*inputs)
    y_ref = LoopTier()(*inputs)
    dy = torch.randn(y.shape, generator=gen)
    grads = torch.autograd.grad(y, (inputs[0], inputs[2], inputs[3]), dy)
    grads_ref = torch.autograd.grad(y_ref, (inputs[0], inputs[2], inputs[3]), dy)
    assert rel_err(y, y_ref) < MXFP8_MLP_RTOL
    for grad, grad_ref in zip(grads, grads_ref):
        assert rel_err(grad, grad_ref) < MXFP8_MLP_RTOL


def test_tier_handles_no_rows_at_all():
    gen = torch.Generator().manual_seed(6)
    x_RD, _, gate_up, down = mlp_inputs(gen)
    x_RD = x_RD[:0].detach().requires_grad_()
    y = DeviceMXFP8Tier("mxfp8-emulated")(x_RD, torch.zeros(4, dtype=torch.int64), gate_up, down)
    assert y.shape == (0, x_RD.shape[1])
    y.sum().backward()
    assert gate_up.grad.eq(0).all() and down.grad.eq(0).all()


# --- no host synchronisation -----------------------------------------------------------------

def _shape_only_kernel(mat_a, mat_b, scale_a, scale_b, offs=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_grouped_mm's output shape, no arithmetic: the kernel itself reads the
    offsets on the device, so only what the tier does around it is under test here."""
    if mat_b.dim() == 3:
        return torch.zeros(mat_a.shape[0], mat_b.shape[2], dtype=out_dtype)
    return torch.zeros(offs.numel(), mat_a.shape[0], mat_b.shape[1], dtype=out_dtype)


@pytest.mark.parametrize("gemms", ["mxfp8-emulated", "fp8-hopper"])
def test_no_synchronising_op_in_forward_and_backward(gemms):
    """The CPU half of tests/gpu's set_sync_debug_mode("error") check: every aten op the
    tier issues, forward and backward, is one that never waits for the GPU."""
    with OpRecorder() as recorder:
        t = torch.zeros(3, dtype=torch.int64)
        t[-1] = 1
    assert "aten.lift_fresh" in recorder.ops  # the recorder does see such ops

    gen = torch.Generator().manual_seed(10)
    x_RD, counts, gate_up, down = mlp_inputs(gen)
    dy = torch.randn(x_RD.shape, generator=gen)
    if gemms == "mxfp8-emulated":
        tier = DeviceMXFP8Tier("mxfp8-emulated")
    else:
        hopper_gemms = FP8HopperGemms(_shape_only_kernel)

        def tier(x_RD, counts, gate_up, down):
            padded = padded_rows(counts, x_RD.shape[0], hopper_gemms.row_align, hopper_gemms.min_rows)
            y_QD = scaled_grouped_swiglu(pad_rows(x_RD, padded), padded.offsets_L, gate_up, down, hopper_gemms)
            return unpad_rows(y_QD, padded)

    with OpRecorder() as recorder:
        torch.autograd.grad(tier(x_RD, counts, gate_up, down), (x_RD, gate_up, down), dy)
    assert recorder.ops and not recorder.ops & SYNCHRONISING_OPS


# --- choosing the mode ----------------------------------------------------------------------


def test_auto_mode_by_device():
    assert select_mode("auto", "cuda", (9, 0)) == "fp8-hopper"
    assert select_mode("auto", "cuda", (10, 0)) == "mxfp8-te"
    assert select_mode("mxfp8-emulated", "cuda", (8, 0)) == "mxfp8-emulated"


@pytest.mark.parametrize("mode, device_type, capability, te_reason, message", [
    ("auto", "cpu", None, None, "no 8-bit grouped GEMM for cpu; use --fp8.mode mxfp8-emulated"),
    ("auto", "cuda", (8, 0), None, "no 8-bit grouped GEMM for cuda sm_80"),
    ("auto", "cuda", (12, 0), None, "no 8-bit grouped GEMM for cuda sm_120"),
    ("auto", "cuda", (10, 0), "not installed", "mode 'mxfp8-te' (picked by mode 'auto') here: not installed"),
    ("mxfp8-te", "cuda", (9, 0), None, "need a Blackwell GPU (sm_100 to sm_110), this one is sm_90"),
    ("fp8-hopper", "cuda", (10, 0), None, "needs a Hopper GPU (sm_90) and this one is sm_100"),
    ("fp8-hopper", "cpu", None, None, "needs a CUDA GPU"),
    ("mxfp8-te", "cpu", None, None, "needs a CUDA GPU"),
])
def test_modes_that_cannot_run_say_why_in_one_line(mode, device_type, capability, te_reason, message):
    with pytest.raises(TierUnavailable, match=re.escape(message)) as error:
        select_mode(mode, device_type, capability, lambda: te_reason)
    assert "\n" not in str(error.value)


def test_tier_from_the_registry_describes_what_runs():
    tier = make_tier("device_mxfp8")
    assert tier.name == "device_mxfp8" and tier.requested_mode == "auto"
    with pytest.raises(RuntimeError):
        tier.describe()
    with pytest.raises(TierUnavailable):  # auto never picks emulation
        tier.check_available(torch.device("cpu"))
    tier = make_tier("device_mxfp8", load_config(None, {"tier": "device_mxfp8", "fp8.mode": "mxfp8-emulated"}))
    tier.check_available(torch.device("cpu"))
    assert tier.describe() == {
        "recipe": "mxfp8-emulated",
        "kernel": "torch.nn.functional.grouped_mm on MXFP8-dequantised operands",
        "device": "cpu",
        "precision": "mxfp8",
    }
    with pytest.raises(TierUnavailable):
        DeviceMXFP8Tier("fp8-hopper").check_available("cpu")
    with pytest.raises(UserError, match="mode must be one of"):
        DeviceMXFP8Tier("fp8")


def test_break_even_setting_reaches_the_tier_and_only_fp8_hopper_uses_it():
    cfg = load_config(None, {"tier": "device_mxfp8", "fp8.mode": "fp8-hopper", "fp8.min_rows_per_expert": "100000"})
    assert make_tier("device_mxfp8", cfg).min_rows_per_expert == 100000
    assert load_config(None, {}).fp8.min_rows_per_expert == 1024
    # The config refuses it in another mode (config_checks.check_needs); the tier ignores it there.
    with pytest.raises(UserError, match="fp8.min_rows_per_expert is tier device_mxfp8's threshold on Hopper"):
        load_config(None, {"tier": "device_mxfp8", "fp8.mode": "mxfp8-emulated", "fp8.min_rows_per_expert": "100000"})
    tier = DeviceMXFP8Tier("mxfp8-emulated", min_rows_per_expert=100000)
    tier.check_available(torch.device("cpu"))
    assert "BF16" not in tier.describe()["kernel"]  # emulation is for numerics: MXFP8 at every size
    gen = torch.Generator().manual_seed(12)
    x_RD, counts, gate_up, down = mlp_inputs(gen)
    y = tier(x_RD, counts, gate_up, down)
    assert not torch.equal(y, make_tier("custom_grouped")(x_RD, counts, gate_up, down))
    with pytest.raises(UserError, match="fp8.min_rows_per_expert must be 0 or more"):
        load_run_config(None, {"tier": "device_mxfp8", "fp8.min_rows_per_expert": "-1"}, 1)


def test_weight_cache_setting_reaches_the_tier_and_only_fp8_hopper_takes_it_off():
    assert load_config(None, {}).fp8.weight_cache
    cfg = load_config(None, {"tier": "device_mxfp8", "fp8.weight_cache": "false"})  # auto: Hopper's on a Hopper GPU
    assert make_tier("device_mxfp8", cfg).cache_weights is False
    # Where auto runs another mode (Blackwell's), the tier says so as it starts: emulation stands in here.
    with pytest.raises(UserError, match="fp8.weight_cache false is for tier device_mxfp8 in mode fp8-hopper") as error:
        DeviceMXFP8Tier("mxfp8-emulated", cache_weights=False).check_available(torch.device("cpu"))
    assert "mode 'mxfp8-emulated', which runs here" in str(error.value)
    assert "\n" not in str(error.value)
    # Named where the config loads, before any data is read: another tier, or a mode that is not Hopper's.
    for overrides in ({"tier": "custom_grouped"}, {"tier": "device_mxfp8", "fp8.mode": "mxfp8-te"}):
        with pytest.raises(UserError, match="fp8.weight_cache is for tier device_mxfp8 in mode fp8-hopper"):
            load_run_config(None, {**overrides, "fp8.weight_cache": "false"}, 1)
    load_run_config(None, {"tier": "device_mxfp8", "fp8.weight_cache": "false"}, 1)  # auto: Hopper's


def test_the_break_even_with_fewer_local_experts_asks_for_the_rows_of_four():
    """fp8.min_rows_per_expert is the break-even measured at four local experts. FP8's cost a
    call hardly depends on the experts (at one expert on an H200 it took about 4 ms at every
    size from 16 to 1024 rows, BF16 1.0-1.6 ms), so with fewer experts a call pays only where it
    has the rows in all that four experts at the break-even would have; with more, each expert
    still needs the threshold's rows."""
    for experts, fewest in ((1, 4096), (2, 4096), (3, 4096), (4, 4096), (8, 8192)):  # rows in all
        assert not runs_fp8(fewest - 1, experts, 1024), (experts, fewest)
        assert runs_fp8(fewest, experts, 1024), (experts, fewest)
    assert runs_fp8(1, 1, 0) and runs_fp8(0, 1, 0)  # 0: FP8 at every size


@pytest.mark.parametrize("sizes", [[6, 6, 6, 6], [21, 0, 2, 1], [24]], ids=["even", "uneven", "one_expert"])
def test_fp8_hopper_runs_custom_grouped_under_the_break_even_and_fp8_from_it(sizes):
    """The switch itself, on the CPU, each side bit for bit what it switches to, forward and
    backward: a tier told its mode is fp8-hopper (as check_available would on an H100), with
    the MXFP8 emulation standing in for its FP8 GEMMs (they need the GPU). The rule is on the
    mean rows per local expert, a shape, so an uneven split switches as an even one; one local
    expert needs the rows of four (24 here: four experts' mean of 6)."""
    gen = torch.Generator().manual_seed(13)
    _, _, gate_up, down = mlp_inputs(gen, num_experts=len(sizes))
    counts = torch.tensor(sizes)
    x_RD = torch.randn(int(counts.sum()), gate_up.shape[2], generator=gen, requires_grad=True)
    dy = torch.randn(x_RD.shape, generator=gen)

    def run(ffn):
        y = ffn(x_RD, counts, gate_up, down)
        return (y, *torch.autograd.grad(y, (x_RD, gate_up, down), dy))

    emulated = DeviceMXFP8Tier("mxfp8-emulated")
    emulated.check_available(torch.device("cpu"))
    tier = DeviceMXFP8Tier("fp8-hopper", min_rows_per_expert=7)  # the mean is 6 rows (4 experts), 24 (one)
    tier.mode, tier._device, tier._runner = "fp8-hopper", x_RD.device, emulated._runner
    bf16, fp8 = run(make_tier("custom_grouped")), run(emulated)
    assert not torch.equal(bf16[0], fp8[0])  # the two paths differ: the checks below can fail

    with OpRecorder() as recorder:  # the choice reads shapes only: no op waits for the device
        below = run(tier)
    assert recorder.ops and not recorder.ops & SYNCHRONISING_OPS
    assert all(torch.equal(a, b) for a, b in zip(below, bf16))
    assert tier.calls() == {"bf16 custom_grouped": 1}
    assert ("BF16 custom_grouped kernels for calls under 7 rows per local expert (under 28 rows in all with fewer "
            "than 4 local experts)") in tier.describe()["kernel"]

    for at_or_above in (6, 0):  # the mean itself (one expert: a quarter of its rows), and 0: FP8 at every size
        tier.min_rows_per_expert = at_or_above
        assert all(torch.equal(a, b) for a, b in zip(run(tier), fp8))
    assert tier.calls() == {"bf16 custom_grouped": 1, "fp8-hopper": 2}
    assert "BF16" not in tier.describe()["kernel"]
