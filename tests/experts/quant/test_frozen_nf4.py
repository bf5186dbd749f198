"""quant/nf4.py and quant/frozen_nf4.py on the CPU: a LoRA base held in NF4 alone.

The format against a float64 reference (QLoRA's code values, each block's absmax exactly);
rows that fill from checkpoints and seeded draws; tier custom_grouped over the NF4 base, its
grouped_mm path and its Triton kernels in the interpreter (dequantising inside their K loops,
or whole into a transient copy before each GEMM, as the tier picks by rows per expert),
against float64 over the dequantised weights; the model: a checkpoint loaded
into the NF4 base, merged on export, adapters that PEFT loads onto transformers' Mixtral with
the dequantised base. Resume: tests/training/test_resume.py.

Run directly, the `test_interpreter_*` tests are skipped; `test_nf4_kernels_in_interpreter`
runs them in a fresh process with TRITON_INTERPRET=1 (tests/README.md).
"""

import os
from dataclasses import replace
from functools import partial

import peft
import pytest
import torch
from background import assert_passed, interpreter_run
from conftest import interpreter_runs_reduced_loop_bounds, some_slow
from expert_reference import random_adapters, reference_lora_f64
from experts.quant.test_frozen_fp8 import (
    assert_loads_and_exports_merged,
    assert_seeded_base_is_bf16_quantised,
    export,
)
from experts.test_adapters import assert_close, run_with_adapters
from experts.test_custom_grouped import TINY, make_inputs
from model.test_hf_parity import random_packed_batch, rel_err
from model.test_lora import ALL_TARGETS, SINGLE, VOCAB, hf_checkpoint, run_config, small_tokenizer

from te_mixtral.config import LoRAConfig
from te_mixtral.errors import Diverged
from te_mixtral.experts.adapters import with_fused_adapters
from te_mixtral.experts.base import ExpertLoad
from te_mixtral.experts.custom_grouped import (
    NF4_TILE_BY_TILE_UP_TO,
    CustomGroupedTier,
    dequantizes_whole,
    grouped_mm_swiglu,
)
from te_mixtral.experts.grouped_mm import offsets
from te_mixtral.experts.quant.frozen_nf4 import FrozenNF4Weight
from te_mixtral.experts.quant.nf4 import BLOCK, dequantize_nf4, quantize_nf4
from te_mixtral.measure.capacity import GiB
from te_mixtral.model.hf_config import model_config_from_hf
from te_mixtral.model.layers import TORCH
from te_mixtral.model.lora import add_adapters, base_weights
from te_mixtral.model.mixtral import MixtralForCausalLM
from te_mixtral.training.hf_checkpoint import load_hf_weights
from te_mixtral.training.peft_adapters import save_adapter

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")
FP32_REL_TOL = 1e-5
# bitsandbytes' NF4 values (`get_4bit_type("nf4")`), typed out again: the reference.
NF4_F64 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                        -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                        0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
                        0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float64)


def reference_nf4(w_NI: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(code index [N, I], absmax [N, blocks]) in float64, block by block, nearest code by search."""
    rows, width = w_NI.shape
    index = torch.empty(rows, width, dtype=torch.int64)
    absmax = torch.zeros(rows, (width + BLOCK - 1) // BLOCK, dtype=torch.float64)
    for b, start in enumerate(range(0, width, BLOCK)):
        block = w_NI[:, start:start + BLOCK].double()
        absmax[:, b] = block.abs().amax(-1)
        normed = block / torch.where(absmax[:, b:b + 1] == 0, 1.0, absmax[:, b:b + 1])
        index[:, start:start + BLOCK] = (normed[..., None] - NF4_F64).abs().argmin(-1)
    return index, absmax


def dequantized_f64(weight: FrozenNF4Weight) -> torch.Tensor:
    """The weight's stored codes and block scales decoded in float64: QLoRA's code values
    typed out above, picked by each nibble, times its block's absmax."""
    width = weight.row_width
    index = torch.stack((weight.packed >> 4, weight.packed & 15), -1).flatten(-2)[..., :width].long()
    return NF4_F64[index] * weight.scale.double().repeat_interleave(BLOCK, -1)[..., :width]


def nf4_weights(gate_up, down):
    stacks = []
    for w in (gate_up, down):
        stacks.append(FrozenNF4Weight(w.shape))
        stacks[-1].copy_(w)
    return stacks


def test_quantise_and_dequantise_match_a_float64_reference():
    """Odd width (the last block short, the last byte half-filled), rows of very different
    magnitude, and an all-zero block (its values code to 0)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 2 * BLOCK + 7, generator=gen) * torch.logspace(-3, 2, 6)[:, None]
    w[2, BLOCK:2 * BLOCK] = 0
    packed, absmax = quantize_nf4(w)
    index, want_absmax = reference_nf4(w)
    assert packed.dtype == torch.uint8 and packed.shape == (6, BLOCK + 4)
    assert torch.equal(absmax.double(), want_absmax)  # the block's absmax, exactly
    unpacked = torch.stack([packed >> 4, packed & 15], -1).flatten(-2)[:, :w.shape[1]].long()
    assert torch.equal(unpacked, index)
    assert (index[2, BLOCK:2 * BLOCK] == 7).all()  # CODE[7] == 0
    want = (NF4_F64[index] * want_absmax.repeat_interleave(BLOCK, -1)[:, :w.shape[1]]).float()
    assert torch.equal(dequantize_nf4(packed, absmax, w.shape[1]), want)
    assert torch.equal(dequantize_nf4(packed, absmax, w.shape[1], torch.bfloat16), want.bfloat16())
    # Every block's largest value comes back exactly (code +-1).
    assert torch.equal(dequantize_nf4(packed, absmax, w.shape[1]).abs().amax(-1), w.abs().amax(-1))


def test_rows_fill_from_tensors_and_from_seeded_draws():
    gen = torch.Generator().manual_seed(3)
    weight = FrozenNF4Weight((3, 8, 70))
    assert weight.shape == (3, 8, 70) and weight.numel() == 3 * 8 * 70
    rows = torch.randn(4, 70, generator=gen)
    weight[1, 2:6].copy_(rows)
    packed, absmax = quantize_nf4(rows)
    assert torch.equal(weight.packed[1, 2:6], packed) and torch.equal(weight.scale[1, 2:6], absmax)
    assert torch.equal(weight.dequantized()[1, 2:6], dequantize_nf4(packed, absmax, 70))
    with pytest.raises(ValueError, match="cannot fill NF4 rows of shape"):
        weight[0].copy_(torch.zeros(8, 69))
    weight[2].normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
    drawn = torch.empty(8, 70, dtype=weight.source_dtype).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(5))
    assert torch.equal(weight.packed[2], quantize_nf4(drawn)[0])


@pytest.mark.parametrize("targets", [("gate_up", "down"), ("down",)], ids=["both", "down"])
@pytest.mark.parametrize("splits", [[21, 0, 0, 34, 1], [0, 0]], ids=["uneven", "no_rows"])
def test_the_tier_over_an_nf4_base_matches_float64(targets, splits):
    """The grouped_mm path (the CPU's): the weights dequantised, then multiplied; y and the
    gradients of x and every adapter tensor against float64 over the dequantised weights."""
    x, counts, gate_up, down, dy = make_inputs(splits, 21, 36, seed=2)
    w1, w2 = nf4_weights(gate_up, down)
    pairs = random_adapters(splits, 21, 36, rank=3, seed=4, targets=targets)
    tier = CustomGroupedTier("nf4")
    assert isinstance(tier.expert_weight((2, 4, 8), frozen=True), FrozenNF4Weight)
    # A base that trains, or one frozen in the default format, is a parameter.
    assert isinstance(tier.expert_weight((2, 4, 8)), torch.nn.Parameter)
    assert isinstance(CustomGroupedTier().expert_weight((2, 4, 8), frozen=True), torch.nn.Parameter)
    got = run_with_adapters(tier, x, counts, w1, w2, pairs, 0.9, dy)
    want = reference_lora_f64(x, splits, w1.dequantized(), w2.dequantized(), pairs, 0.9, dy)
    if sum(splits) == 0:
        assert all(torch.equal(g, torch.zeros_like(g)) for g in got[1:])
    else:
        assert_close(got, want, f"nf4 {targets}")


def test_the_tier_dequantises_whole_above_128_rows_per_expert_and_counts_the_copy():
    """The choice, from rows per local expert on the host, and what the memory estimate
    counts for it: one transient copy of gate_up [L, 2F, D] in the activations' dtype, made
    while a layer runs, none kept for the backward; none where the tiles decode."""
    assert NF4_TILE_BY_TILE_UP_TO == 128
    for experts in (1, 2, 8):
        assert not dequantizes_whole(128 * experts, experts) and dequantizes_whole(128 * experts + 1, experts)
    assert not dequantizes_whole(16, 8)  # decoding a token
    cfg = run_config(LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS, base="nf4"))
    cfg = replace(cfg, model=replace(cfg.model, hidden_size=4096, intermediate_size=14336))
    many = CustomGroupedTier.memory(cfg, ExpertLoad("cuda", 8 * 2048, 8, activation_bytes=2, weight_bytes=2))
    assert many.weight_copies == 2 * 8 * 2 * 14336 * 4096  # gate_up's BF16 copy: 1.75 GiB
    assert round(many.weight_copies / GiB, 2) == 1.75
    assert many.weight_copies_saved == many.weight_copies_cached == 0
    assert many.holds == "its experts in NF4"
    for load in (ExpertLoad("cuda", 8 * 128, 8, 2, 2), ExpertLoad("cpu", 8 * 2048, 8, 4, 4)):
        assert CustomGroupedTier.memory(cfg, load).weight_copies == 0


# --- the Triton kernels over an NF4 base, in the interpreter -------------------------

INTERPRETER_RUN = interpreter_run(__file__)
PLANNED_COMMANDS = [INTERPRETER_RUN]


@pytest.mark.skipif(INTERPRETING, reason="this is the launcher")
@interpreter_runs_reduced_loop_bounds
def test_nf4_kernels_in_interpreter(planned_command):
    assert_passed(planned_command(INTERPRETER_RUN)[0], __file__)


@interpreter_only
def test_interpreter_the_whole_weight_kernel_matches_float64():
    """`nf4_decode.dequantize` against the stored codes decoded in float64, rounded to fp32
    once: the same bits (a product of two float32 values is exact in float64): stacks
    whose rows and widths leave every tile ragged (rows not a multiple of its 32, widths
    odd, past one and two 256-value tiles, under one 64-value block), rows of very different
    magnitude and an all-zero block."""
    from te_mixtral.experts.kernels.nf4_decode import DEQUANTIZE_TILE, dequantize

    assert DEQUANTIZE_TILE[:2] == (32, 256)
    gen = torch.Generator().manual_seed(11)
    for shape in ((3, 37, 301), (2, 5, 7), (1, 70, 2 * 256 + 65)):
        w = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[1])[:, None]
        w[0, 1, :BLOCK] = 0
        weight = FrozenNF4Weight(shape)
        weight.copy_(w)
        got = dequantize(weight.operand(), torch.float32)
        assert got.shape == shape and got.is_contiguous()
        assert torch.equal(got, dequantized_f64(weight).float()), shape


NF4_CASES = {
    # name: (splits, D, F, tiles, keep_hidden): D odd (a half-filled last byte per row of
    # gate_up, a short last block), F past one block; the K tails and every row tile masked.
    "uneven_odd_width": ([13, 0, 0, 20, 1], 21, 70, dict(TINY, BLOCK_N=32, BLOCK_I=32), True),
    # tiles 128 wide along the packed rows, past one scale block each (the kernels' tables
    # read NF4 tiles so): D and F past two blocks, neither a multiple of 64
    "wide_tiles": ([19, 0, 30], 150, 200, dict(TINY, BLOCK_N=128, BLOCK_I=128), True),
    "shipped_tiles_recomputed": ([33, 0, 17], 40, 24, None, False),
    # Every row GEMM's last round streamed (test_custom_grouped's split_every_gemm): the
    # adapters' additions made once, by the piece that finishes a tile.
    "streamed_recomputed": ([3, 0, 40], 20, 20, "split", False),
}


@interpreter_only
@pytest.mark.parametrize("case", some_slow(NF4_CASES, ("uneven_odd_width", "wide_tiles", "streamed_recomputed")))
def test_interpreter_nf4_kernels_match_the_torch_path(case):
    """The kernels dequantise each weight tile in their K loop (forward, the SwiGLU-gradient
    dgrad and gate_up's dgrad), the adapters fused as over a BF16 base: in fp32 the same
    numbers as dequantising whole and multiplying in torch, and as float64 over the
    dequantised weights; selective recompute changes nothing, bit for bit."""
    from experts.test_custom_grouped import SPLIT

    from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, grouped_swiglu

    splits, D, F_, tiles, keep_hidden = NF4_CASES[case]
    per_op = dict.fromkeys(CONFIGS["large"], TINY if tiles == "split" else tiles)
    if tiles == "split":
        per_op |= SPLIT
    configs = None if tiles is None else dict.fromkeys(CONFIGS, per_op)
    x, counts, gate_up, down, dy = make_inputs(splits, D, F_, seed=len(case))
    w1, w2 = nf4_weights(gate_up, down)
    pairs = random_adapters(splits, D, F_, rank=3, seed=6)

    def kernels(x_RD, counts_L, g, d, adapters, keep=keep_hidden):  # as custom_grouped.kernels_swiglu, own tiles
        op = partial(grouped_swiglu, x_RD, counts_L, g, d, configs=configs, keep_hidden=keep)
        return with_fused_adapters(op, x_RD, offsets(counts_L), adapters, recompute=not keep)

    got = run_with_adapters(kernels, x, counts, w1, w2, pairs, 0.9, dy)
    assert_close(got, run_with_adapters(grouped_mm_swiglu, x, counts, w1, w2, pairs, 0.9, dy), case)
    assert_close(got, reference_lora_f64(x, splits, w1.dequantized(), w2.dequantized(), pairs, 0.9, dy), case)
    if not keep_hidden:
        kept = run_with_adapters(lambda *a: kernels(*a, keep=True), x, counts, w1, w2, pairs, 0.9, dy)
        assert all(torch.equal(a, b) for a, b in zip(got, kept))


def counting_whole_dequantisations(monkeypatch) -> list:
    """The weights `grouped_swiglu` decodes whole, one entry a call: the real kernel runs,
    and each call's [L, N, I] lands in the list."""
    from te_mixtral.experts.kernels import grouped_swiglu as op

    calls, dequantize = [], op.dequantize

    def counted(w, dtype):
        calls.append(tuple(w.shape))
        return dequantize(w, dtype)

    monkeypatch.setattr(op, "dequantize", counted)
    return calls


@interpreter_only
@pytest.mark.parametrize("keep_hidden", some_slow([True, False], [False]), ids=["kept", "recomputed"])
def test_interpreter_the_tier_decodes_whole_above_128_rows_per_expert(keep_hidden, monkeypatch):
    """Through the tier's own choice (`CustomGroupedTier._kernels`, what CUDA runs): at 129
    rows per expert each GEMM that reads the NF4 base gets a whole copy of its own (forward:
    gate_up, down; backward: the recompute's gate_up, down's dgrad, gate_up's dgrad), at 128
    none does; both give y and every adapter gradient of float64 over the dequantised weights,
    and at 129 rows the bits of the tile-by-tile path (the same tiles, fp32)."""
    from te_mixtral.experts.custom_grouped import kernels_swiglu

    calls = counting_whole_dequantisations(monkeypatch)
    D, F_ = 12, 20
    for per_expert in (NF4_TILE_BY_TILE_UP_TO + 1, NF4_TILE_BY_TILE_UP_TO):
        splits = [per_expert + 30, per_expert - 30]  # uneven: the choice reads the mean
        x, counts, gate_up, down, dy = make_inputs(splits, D, F_, seed=9)
        w1, w2 = nf4_weights(gate_up, down)
        pairs = random_adapters(splits, D, F_, rank=3, seed=6)
        calls.clear()
        got = run_with_adapters(lambda *a: CustomGroupedTier._kernels(*a[:4], keep_hidden, a[4]),
                                x, counts, w1, w2, pairs, 0.9, dy)
        whole = per_expert > NF4_TILE_BY_TILE_UP_TO
        gemms = [gate_up, down] + ([] if keep_hidden else [gate_up]) + [down, gate_up]
        assert calls == ([tuple(w.shape) for w in gemms] if whole else []), per_expert
        assert_close(got, reference_lora_f64(x, splits, w1.dequantized(), w2.dequantized(), pairs, 0.9, dy),
                     f"{per_expert} rows per expert")
        if whole:
            tiles = run_with_adapters(partial(kernels_swiglu, keep_hidden=keep_hidden), x, counts, w1, w2, pairs,
                                      0.9, dy)
            assert all(torch.equal(a, b) for a, b in zip(got, tiles))


# --- the model over an NF4 base ---------------------------------------------------------

def nf4_model(folder, lora: LoRAConfig, seed=7):
    ours = MixtralForCausalLM(model_config_from_hf(folder), TORCH, SINGLE, CustomGroupedTier("nf4"), frozen_base=True)
    load_hf_weights(ours, folder, SINGLE)
    add_adapters(ours, lora, seed, SINGLE)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if name.endswith(".B"):
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return ours


def test_a_seeded_nf4_base_is_the_seeded_bf16_base_quantised():
    assert_seeded_base_is_bf16_quantised(CustomGroupedTier("nf4"), quantize_nf4)


def test_a_checkpoint_loads_into_an_nf4_base_which_exports_merged(tmp_path):
    """Per-expert w1, w3, w2 quantised into their rows as they load; not in the state dict;
    the weight count is the model's; --save-hf writes the dequantised base, adapters merged;
    a NaN in a block (its absmax NaN) is refused on export."""
    hf = hf_checkpoint(tmp_path / "base", dtype=torch.float32)
    ours = nf4_model(tmp_path / "base", LoRAConfig(rank=3, alpha=6.0, targets=ALL_TARGETS))
    assert_loads_and_exports_merged(ours, hf, tmp_path / "merged", quantize_nf4)

    row = torch.randn(40)
    row[3] = float("nan")
    ours.model.layers[0].mlp.experts.down_proj[2, 5:6].copy_(row[None])
    with pytest.raises(Diverged, match="the weights are not finite"):
        export(ours, tmp_path / "merged-nan")


def test_peft_loads_the_adapters_onto_the_dequantised_base(tmp_path):
    """The adapters trained over the NF4 base, saved in PEFT's format, loaded by PEFT onto
    transformers' Mixtral whose experts hold the dequantised base: the same logits."""
    lora = LoRAConfig(rank=4, alpha=8.0, targets=ALL_TARGETS)
    hf = hf_checkpoint(tmp_path / "base", dtype=torch.float32)
    ours = nf4_model(tmp_path / "base", lora)
    with torch.no_grad():
        for name, weight in base_weights(ours).items():
            if isinstance(weight, FrozenNF4Weight):
                dict(hf.named_parameters())[name].copy_(weight.dequantized())
    save_adapter(ours, tmp_path / "adapter", run_config(lora), SINGLE, small_tokenizer())
    reference = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter")
    batch = random_packed_batch(VOCAB)
    with torch.no_grad():
        want = reference(input_ids=batch.input_ids, position_ids=batch.packed.position_ids_BS, use_cache=False).logits
        got = ours(batch.input_ids, batch.packed)
    assert rel_err(got, want) < 1e-5
