"""custom_grouped's BF16 tables cut for GPUs whose blocks get 99 KiB of shared memory
(`SMALL_SHARED_CONFIGS`: sm_86, sm_89), run on whatever GPU this is: the one query the
choice reads (`shared_memory_per_block`) answers 99 KiB here, so the tier picks those tables
as an L40S would. In every regime, full fine-tuning (the BF16 weights' gradients too) and
LoRA over an NF4 base decoded whole, each against float64 and against the same inputs
through this GPU's own tables, within the bars of test_custom_grouped_gpu.py: bf16 operands
with fp32 accumulation land between 1e-3 and 1e-2 of float64, and the cut tiles, which sum in
another order, must be no less accurate (GMM_ERROR_FACTOR). Through pointer loads, as on
sm_86 and sm_89 (no TMA before Hopper), and through the TMA loads this GPU takes where the
sizes call for them."""

import contextlib

import pytest
import torch
from expert_reference import random_adapters, random_expert_inputs, reference_f64, reference_lora_f64, rel_err, run_tier
from experts.test_adapters import run_with_adapters
from gpu.test_custom_grouped_gpu import BF16_REL_TOL, GMM_ERROR_FACTOR, NAMES, check
from gpu.test_lora_gpu import F_, RANK, D
from gpu.test_nf4_gpu import counting_whole_dequantisations, nf4_inputs

from te_mixtral.experts.custom_grouped import CustomGroupedTier
from te_mixtral.experts.kernels import grouped_swiglu as op

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# Rows over experts, one split a regime (`regime`), at D, F = 256, 384.
REGIMES = {
    "few rows, 16": [9, 0, 14, 5],
    "few rows, 32": [30, 20, 0, 28],
    "few rows, 64": [60, 0, 50, 64],
    "two row tiles": [100, 0, 120],
    "medium, few rows": [200, 0, 190],
    "medium": [300, 100, 250, 200],
    "large": [1200, 0, 700, 800],
}


@contextlib.contextmanager
def tables(small: bool, pointer_loads: bool):
    """The tier's tables inside: the cut ones (as on a GPU of 99 KiB a block) or this GPU's
    own; with `pointer_loads` no TMA descriptors."""
    with pytest.MonkeyPatch.context() as patch:
        if small:
            patch.setattr(op, "shared_memory_per_block", lambda index: 99 * 1024)
        if pointer_loads:
            patch.setattr(op, "tma_ok", lambda *tensors: False)
        assert (op.bf16_configs(torch.device("cuda")) is op.SMALL_SHARED_CONFIGS) == small
        yield


def assert_as_accurate(small, full, ref, names, what):
    """The cut tables' outputs `small` within BF16_REL_TOL of float64 and of this GPU's tables'
    `full`, and no less accurate than those."""
    for name, s, f, r in zip(names, small, full, ref):
        err, full_err = rel_err(s, r), rel_err(f, r)
        assert torch.isfinite(s).all() and err <= BF16_REL_TOL, f"{what} {name}: error {err:.2e}"
        assert err <= GMM_ERROR_FACTOR * full_err, f"{what} {name}: error {err:.2e}, the full tables' {full_err:.2e}"
        apart = rel_err(s, f.double())
        assert apart <= BF16_REL_TOL, f"{what} {name}: {apart:.2e} from the full tables' result"


@pytest.mark.parametrize("loads", ["pointers", "default"])
@pytest.mark.parametrize("case", REGIMES)
def test_full_fine_tuning_through_the_small_shared_tables(case, loads):
    splits = REGIMES[case]
    assert op.regime(sum(splits), len(splits)) == case
    inputs = random_expert_inputs(splits, 256, 384, seed=len(case))
    ref = reference_f64(inputs[0], splits, *inputs[2:])
    got = {}
    for small in (False, True):
        with tables(small, pointer_loads=loads == "pointers"):
            got[small] = run_tier(CustomGroupedTier(), *inputs)
    check(got[True], ref, splits, f"{case} {loads}")
    assert_as_accurate(got[True], got[False], ref, NAMES, f"{case} {loads}")


@pytest.mark.parametrize("case", ["medium", "large"])
def test_nf4_base_decoded_whole_through_the_small_shared_tables(case, monkeypatch):
    """Above 128 rows per expert the NF4 base is decoded whole into BF16 copies that the BF16
    tables multiply: on sm_86 and sm_89 the cut ones."""
    splits = REGIMES[case]
    x, counts, gate_up, down, dy = nf4_inputs(splits, seed=len(case))
    pairs = random_adapters(splits, D, F_, RANK, seed=3, device="cuda", dtype=torch.bfloat16)
    want = reference_lora_f64(x, splits, gate_up.dequantized(torch.bfloat16), down.dequantized(torch.bfloat16),
                              pairs, 2.0, dy)
    calls = counting_whole_dequantisations(monkeypatch)
    got = {}
    for small in (False, True):
        with tables(small, pointer_loads=True):
            got[small] = run_with_adapters(CustomGroupedTier("nf4"), x, counts, gate_up, down, pairs, 2.0, dy)
    assert calls == [torch.bfloat16] * 8, "each run decodes the base whole four times"
    names = ("y", "dx", "dA_gate_up", "dB_gate_up", "dA_down", "dB_down")
    assert_as_accurate(got[True], got[False], want, names, case)
