"""LoRA over a frozen NF4 base (experts/quant/frozen_nf4.py) on a CUDA GPU: the compiled
Triton kernels, dequantising NF4 tiles into BF16 dots or, above 128 rows per expert, each
weight whole into a transient BF16 copy that the BF16 tables multiply, against float64 over
the dequantised weights (the tolerance of test_lora_gpu.py: bf16 operands land between 1e-3
and 1e-2), with selective recompute and with no host synchronisation; and our NF4 against
bitsandbytes' on the same weights, where bitsandbytes is installed."""

import importlib.util

import pytest
import torch
from expert_reference import GPU_SPLITS, random_adapters, reference_lora_f64
from experts.test_adapters import run_with_adapters
from gpu.test_lora_gpu import F_, RANK, D, assert_within_bf16, inputs

from te_mixtral.experts.custom_grouped import CustomGroupedTier, dequantizes_whole
from te_mixtral.experts.kernels import grouped_swiglu as op
from te_mixtral.experts.kernels.nf4_decode import dequantize
from te_mixtral.experts.quant.frozen_nf4 import FrozenNF4Weight

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
# 140 rows per expert: the tier decodes the NF4 base whole (GPU_SPLITS' cases have 108 or fewer)
WHOLE_SPLITS = [300, 0, 170, 90]


def nf4_inputs(splits, seed):
    x, counts, gate_up, down, dy = inputs(splits, seed)
    stacks = []
    for w in (gate_up, down):
        stacks.append(FrozenNF4Weight(w.shape).cuda())
        stacks[-1].copy_(w)
    return x, counts, *stacks, dy


def counting_whole_dequantisations(monkeypatch) -> list:
    """The dtypes of the whole copies `grouped_swiglu` makes, one a call of the real kernel."""
    calls, real = [], op.dequantize
    monkeypatch.setattr(op, "dequantize", lambda w, dtype: calls.append(dtype) or real(w, dtype))
    return calls


@pytest.mark.parametrize("keep_hidden", [True, False], ids=["kept", "recomputed"])
@pytest.mark.parametrize("case", ["uneven", "zero_middle", "one_expert", "whole"])
def test_nf4_kernels_with_adapters_match_float64(case, keep_hidden, monkeypatch):
    """Tile by tile at GPU_SPLITS' rows; at WHOLE_SPLITS' each GEMM that reads the base gets
    a BF16 copy of its own: two in the forward, two or (recomputing gate_up) three in the
    backward, none saved between them."""
    splits = WHOLE_SPLITS if case == "whole" else GPU_SPLITS[case]
    whole = dequantizes_whole(sum(splits), len(splits))
    assert whole == (case == "whole")
    x, counts, gate_up, down, dy = nf4_inputs(splits, seed=len(case))
    tier = CustomGroupedTier("nf4")
    tier.check_available(torch.device("cuda"))
    call = tier if keep_hidden else tier.recompute_hidden
    pairs = random_adapters(splits, D, F_, RANK, seed=3, device="cuda", dtype=torch.bfloat16)
    calls = counting_whole_dequantisations(monkeypatch)
    got = run_with_adapters(call, x, counts, gate_up, down, pairs, 2.0, dy)
    assert calls == ([torch.bfloat16] * (4 if keep_hidden else 5) if whole else [])
    want = reference_lora_f64(x, splits, gate_up.dequantized(torch.bfloat16), down.dequantized(torch.bfloat16),
                              pairs, 2.0, dy)
    assert_within_bf16(got, want, case)


def test_the_whole_weight_kernel_is_the_torch_dequantisation():
    """Compiled, bit for bit in BF16 at 8x7B's row widths (4096 and 14336 values a row)."""
    for shape in ((2, 96, 4096), (2, 40, 14336)):
        w = FrozenNF4Weight(shape).cuda()
        w.copy_(torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)))
        assert torch.equal(dequantize(w.operand(), torch.bfloat16), w.dequantized(torch.bfloat16))


@pytest.mark.parametrize("whole", [False, True], ids=["tiles", "whole"])
def test_nf4_kernels_never_synchronise(whole):
    splits = WHOLE_SPLITS if whole else GPU_SPLITS["uneven"]
    x, counts, gate_up, down, dy = nf4_inputs(splits, seed=4)
    pairs = random_adapters(splits, D, F_, RANK, seed=3, device="cuda", dtype=torch.bfloat16)
    tier = CustomGroupedTier("nf4")
    run_with_adapters(tier, x, counts, gate_up, down, pairs, 2.0, dy)  # compile outside
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run_with_adapters(tier, x, counts, gate_up, down, pairs, 2.0, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")
def test_our_nf4_is_bitsandbytes_nf4():
    """Rows whose width is a multiple of 64 block as bitsandbytes blocks the flattened
    tensor: the dequantised weights agree but for values on a midpoint between two codes,
    which the two round apart by a float32 ulp of the division (none expected in this draw,
    at most a handful)."""
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    w = torch.randn(64, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0)).bfloat16()
    ours = FrozenNF4Weight(w.shape).cuda()
    ours.copy_(w)
    packed, state = quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=False)
    theirs = dequantize_4bit(packed, state, blocksize=64, quant_type="nf4")
    assert torch.equal(state.absmax.float().view(64, -1), ours.scale)
    differ = (ours.dequantized(torch.bfloat16) != theirs).sum().item()
    assert differ <= 8, f"{differ} of {w.numel()} values differ from bitsandbytes'"
