"""The `custom_grouped` tier on the CPU: its grouped_mm path, and its Triton kernels run by
Triton's interpreter, both against a float64 loop over experts.

Forward and all three gradients are compared by relative Frobenius error
||out - ref|| / ||ref||. FP32_REL_TOL: fp32 arithmetic lands near 1e-7; a wrong index, a
missed tile or an unwritten row lands far above.

The interpreter must be switched on (TRITON_INTERPRET=1) before triton is first imported,
so `test_triton_kernels_in_interpreter` reruns this file's `interpreter` tests in a fresh
pytest process with the variable set; run directly they are skipped. The interpreter is
exact in fp32 and meaningless in bf16, so those tests use fp32 and small odd shapes.
"""

import os

import pytest
import torch
from background import assert_passed, interpreter_run
from conftest import interpreter_runs_reduced_loop_bounds, some_slow
from expert_reference import reference_f64

from te_mixtral.experts.registry import make_tier

FP32_REL_TOL = 1e-5
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")

SPLITS = {
    "uneven": [3, 11, 1, 7],
    "zero_first": [0, 9, 4, 2],
    "zero_middle": [6, 0, 0, 5],
    "one_expert": [0, 0, 13, 0],
}


def make_inputs(splits, D, F_, seed):
    """Fresh random (never zero) fp32 inputs: x, tokens_per_expert, gate_up, down, dy."""
    g = torch.Generator().manual_seed(seed)
    E, R = len(splits), sum(splits)
    return (
        torch.randn(R, D, generator=g),
        torch.tensor(splits, dtype=torch.int64),
        torch.randn(E, 2 * F_, D, generator=g) * D**-0.5,
        torch.randn(E, D, F_, generator=g) * F_**-0.5,
        torch.randn(R, D, generator=g),
    )


def run(fn, x_RD, tokens_per_expert_L, gate_up_L2FD, down_LDF, dy_RD):
    leaves = [t.detach().clone().requires_grad_() for t in (x_RD, gate_up_L2FD, down_LDF)]
    y = fn(leaves[0], tokens_per_expert_L, leaves[1], leaves[2])
    return (y, *torch.autograd.grad(y, leaves, dy_RD))


def assert_matches(got, ref, splits, tol, what):
    for name, out, r in zip(("y", "dx", "d_gate_up", "d_down"), got, ref):
        assert out.shape == r.shape, f"{what} {name}: shape {tuple(out.shape)}"
        err = ((out.double() - r).norm() / r.norm().clamp_min(1e-300)).item()
        assert err <= tol, f"{what} {name}: error {err:.2e}"
    for e, n in enumerate(splits):
        if n == 0:  # an expert with no rows gets exactly zero gradient, nothing stale
            assert torch.equal(got[2][e], torch.zeros_like(got[2][e])), f"{what} expert {e}"
            assert torch.equal(got[3][e], torch.zeros_like(got[3][e])), f"{what} expert {e}"


# --- the tier on the CPU: the grouped_mm path ---------------------------------------


def test_registered_and_available_on_cpu():
    tier = make_tier("custom_grouped")
    assert tier.name == "custom_grouped"
    tier.check_available(torch.device("cpu"))


@pytest.mark.parametrize("case", SPLITS)
@pytest.mark.parametrize("D,F_", [(16, 24), (20, 12)], ids=["aligned", "odd"])
def test_cpu_path_matches_float64(case, D, F_):
    splits = SPLITS[case]
    inputs = make_inputs(splits, D, F_, seed=list(SPLITS).index(case))
    got = run(make_tier("custom_grouped"), *inputs)
    assert_matches(got, reference_f64(inputs[0], splits, *inputs[2:]), splits, FP32_REL_TOL,
                   f"{case} D={D} F={F_}")


# grouped_mm needs 16-byte row strides, so the CPU path zero-pads D and F up to a multiple
# of 4 in fp32 (8 in bf16). The shapes above are multiples of 4; these are not.
@pytest.mark.parametrize("D,F_", [(18, 10), (17, 24), (16, 13), (5, 3)],
                         ids=["pad_both", "pad_d", "pad_f", "tiny"])
def test_cpu_path_padding_matches_float64(D, F_):
    from te_mixtral.experts.custom_grouped import grouped_mm_swiglu

    splits = SPLITS["zero_middle"]
    inputs = make_inputs(splits, D, F_, seed=D * 100 + F_)
    got = run(grouped_mm_swiglu, *inputs)
    assert_matches(got, reference_f64(inputs[0], splits, *inputs[2:]), splits, FP32_REL_TOL, f"D={D} F={F_}")


def test_cpu_path_no_rows_and_expanded_gradient():
    tier = make_tier("custom_grouped")
    x, counts, gate_up, down, _ = make_inputs([0, 0, 0], 16, 8, seed=5)
    y, dx, d_gate_up, d_down = run(tier, x, counts, gate_up, down, torch.empty(0, 16))
    assert y.shape == (0, 16) and dx.shape == (0, 16)
    assert torch.equal(d_gate_up, torch.zeros_like(d_gate_up))
    # y.sum() hands backward a stride-0 gradient, which grouped_mm alone rejects.
    x, counts, gate_up, down, _ = make_inputs([4, 0, 3], 16, 8, seed=6)
    gate_up.requires_grad_()
    tier(x, counts, gate_up, down).sum().backward()
    assert gate_up.grad.shape == gate_up.shape


def test_cpu_path_bf16_activations_keep_weight_grad_dtype():
    x, counts, gate_up, down, dy = make_inputs([5, 0, 7], 16, 8, seed=9)
    y, dx, d_gate_up, d_down = run(make_tier("custom_grouped"), x.bfloat16(), counts, gate_up,
                                   down, dy.bfloat16())
    assert y.dtype == dx.dtype == torch.bfloat16
    assert d_gate_up.dtype == d_down.dtype == torch.float32


def test_every_size_has_its_tile_table():
    """The regime and load choices are measured thresholds; whatever they become, every row
    and expert count must name a tile table that exists, for bf16 and for fp32, or some size
    fails only on a GPU (a KeyError at that size). The benchmark's candidates too, or its
    sweep cannot time that table."""
    from benchmarks.custom_grouped_ops import CANDIDATES
    from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, FP32_CONFIGS, regime, uses_descriptors

    names = {regime(rows, experts) for experts in (1, 2, 3, 4, 8, 16) for rows in range(0, 20000, 7)}
    assert names <= CONFIGS.keys() == FP32_CONFIGS.keys() <= CANDIDATES.keys(), names
    assert names == CONFIGS.keys()  # no table left unreachable
    # Few rows load through pointers, many through TMA descriptors.
    assert not uses_descriptors(64, 1) and uses_descriptors(16384, 8)


def test_gpus_with_99_kib_a_block_get_the_small_shared_tables(monkeypatch):
    """`bf16_configs`, where the BF16 tables are chosen: by the shared memory a block may ask
    on the GPU (the one query, faked here), the full tables from 163 KiB (A100, Hopper), the
    cut ones below (99 KiB: sm_86, sm_89), and the full ones off CUDA; each covers every regime."""
    from te_mixtral.experts.kernels import grouped_swiglu as op

    for kib, want in ((99, op.SMALL_SHARED_CONFIGS), (163, op.CONFIGS), (227, op.CONFIGS)):
        monkeypatch.setattr(op, "shared_memory_per_block", lambda index, kib=kib: kib * 1024)
        assert op.bf16_configs(torch.device("cuda", 1)) is want, f"{kib} KiB"
    assert op.bf16_configs(torch.device("cpu")) is op.CONFIGS
    assert all(op.SMALL_SHARED_CONFIGS[name].keys() == table.keys() for name, table in op.CONFIGS.items())


# --- the Triton kernels, run by the interpreter in a fresh process ------------------

if INTERPRETING:  # triton must not be imported before the variable is set
    import triton
    import triton.language as tl

    from te_mixtral.experts.kernels import stream_k

    @triton.jit
    def _stream_k_probe(out_ptr, owner_ptr, slots_ptr, total, k_blocks, LIMIT: tl.constexpr):
        """(whole, streams) to out; the id of the program that takes each streamed step to
        owner (+1 per program that takes it, so a step taken twice shows); and one count per
        piece in the scratch slot its partial sums take (programs run one after another in
        the interpreter, so a slot two pieces share would not show in a GEMM's result)."""
        pid = tl.program_id(0)
        whole, streams = stream_k.plan(total, k_blocks, tl.num_programs(0), LIMIT)
        tl.store(out_ptr, whole)
        tl.store(out_ptr + 1, streams)
        w0, w1, touched = stream_k.share(pid, streams, (total - whole).to(tl.int64) * k_blocks, k_blocks)
        for j in range(0, touched):
            s, k0, k1 = stream_k.piece(j, w0, w1, k_blocks)
            for k in range(k0, k1):
                tl.atomic_add(owner_ptr + s * k_blocks + k, pid + 1)
            if (k0 > 0) | (k1 < k_blocks):
                tl.atomic_add(stream_k._slot(slots_ptr, pid, w0, s.to(tl.int64) * k_blocks, False, 1, 1), 1)


INTERPRETER_RUN = interpreter_run(__file__)
PLANNED_COMMANDS = [INTERPRETER_RUN]  # run from the session's start (conftest.py's planned_command)


@pytest.mark.skipif(INTERPRETING, reason="this is the launcher")
@interpreter_runs_reduced_loop_bounds
def test_triton_kernels_in_interpreter(planned_command):
    assert_passed(planned_command(INTERPRETER_RUN)[0], __file__)


# Tiles far smaller than the shapes, so every case spans several row and column tiles,
# several swizzle groups and several tiles per program of the persistent loop.
TINY = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_I=16, GROUP_M=2, num_warps=4, num_stages=2)

INTERPRETER_CASES = {
    # name: (splits, D, F, tile table or None for the shipped one, TMA descriptors)
    "uneven_k_tail": ([21, 0, 0, 34, 1], 20, 36, TINY, False),
    "uneven_tma": ([21, 0, 0, 34, 1], 20, 36, TINY, True),
    "one_expert_tma": ([0, 0, 70, 0], 24, 20, TINY, True),
    "64_experts": ([2, 0, 1, 1] * 16, 16, 16, TINY, False),
    "single_row": ([1], 8, 8, TINY, True),
    "two_epilogue_parts": ([9, 30, 0], 16, 32, dict(TINY, EPI_PARTS=2), True),
    "shipped_tiles": ([33, 0, 17], 40, 24, None, False),
    # D and F that are not multiples of 4: row strides that are not 16-byte multiples, the
    # tails masked in every tile (and on the grouped_mm path, the padded shapes).
    "unaligned": ([13, 0, 22], 18, 10, TINY, False),
    # The row GEMMs' last round of tiles streamed over the programs (SPLIT, stream_k.py; the
    # interpreter runs 3 programs). [9, 0, 20, 5] rows make 4 row tiles: down and
    # gate_up_dgrad (N = D, one column tile) run 3 whole and the fourth in 3 and 2 pieces,
    # the last short where F = 36 (an I tail); with F = 64 gate_up and down_dgrad leave one
    # tile of one K step, which one program takes whole.
    "split_tail": ([9, 0, 20, 5], 16, 36, "split", False),
    "split_tail_tma": ([9, 0, 20, 5], 16, 64, "split", True),
    "split_all": ([0, 11], 16, 36, "split", False),  # one tile, all in pieces
    # 5 x 4 = 20 tiles, 2 left, in every GEMM: all four streamed, each with a program whose
    # steps run across both tiles (so it leaves partial sums in both its scratch slots), and
    # D = F = 49 leaves a short last step (an I tail) in every reduction.
    "split_every_gemm": ([3, 0, 53], 49, 49, "split", False),
    # The few-rows tables themselves (shipped_tiles above runs the 32-row one), at widths
    # that make several K steps (F = 200: down's 4 steps of 64, gate_up_dgrad's 7), so that
    # down and gate_up_dgrad stream their tiles over the 6 programs of two a CPU "SM".
    "few_rows_16": ([9, 0, 14], 40, 200, None, False),
    "few_rows_64": ([60, 0, 90], 24, 136, None, False),
    # 65-128 rows over two or three experts ("two row tiles"): two row tiles an expert
    # (three for the 120 rows), several K steps in every GEMM, nothing streamed.
    "two_row_tiles": ([100, 0, 120], 40, 136, None, False),
}
# The default run keeps a case of each kind (uneven, TMA, unaligned, epilogue parts, the shipped
# and few-rows tables, streamed tiles) that takes the interpreter under a second.
SLOW_CASES = ("uneven_tma", "one_expert_tma", "64_experts", "split_tail", "split_tail_tma", "split_every_gemm",
              "few_rows_64")
SPLIT = {op: dict(TINY, TAIL_SPLIT=4) for op in ("gate_up", "down", "down_dgrad")} | {
    "gate_up_dgrad": dict(TINY, TAIL_SPLIT=2)}


@interpreter_only
@pytest.mark.parametrize("case", some_slow(INTERPRETER_CASES, SLOW_CASES))
def test_interpreter_kernels_match_float64(case):
    from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, grouped_swiglu

    splits, D, F_, tiles, use_tma = INTERPRETER_CASES[case]
    per_op = dict.fromkeys(CONFIGS["large"], TINY if tiles == "split" else tiles)
    if tiles == "split":
        per_op |= SPLIT
    configs = CONFIGS if tiles is None else dict.fromkeys(CONFIGS, per_op)
    inputs = make_inputs(splits, D, F_, seed=len(case))

    def op(*args):
        return grouped_swiglu(*args, configs=configs, use_tma=use_tma)

    got = run(op, *inputs)
    assert_matches(got, reference_f64(inputs[0], splits, *inputs[2:]), splits, FP32_REL_TOL,
                   case)
    # Streamed tiles' counters are left zero: the next launch counts on the same ones.
    assert not any(counts.any() for counts in stream_k._ARRIVALS.values())


# The BF16 tables cut for GPUs whose blocks get 99 KiB of shared memory (SMALL_SHARED_CONFIGS),
# at widths that make several K steps and a short last one: gate_up 64 deep over few rows, 128
# x 64 over more, and the large table's 128 x 256 tiles halved (the other cuts are of these kinds).
SMALL_SHARED_CASES = {
    "few rows, 64": ([60, 0, 50], 136, 100),
    "medium, few rows": ([150, 0, 250], 72, 100),
    "large": ([530], 72, 40),
}


@interpreter_only
@pytest.mark.parametrize("table", some_slow(SMALL_SHARED_CASES, ("few rows, 64", "medium, few rows")))
def test_interpreter_small_shared_tables_match_float64(table):
    """The op through the tables an sm_86 or sm_89 GPU gets, with pointer loads as there."""
    from te_mixtral.experts.kernels.grouped_swiglu import SMALL_SHARED_CONFIGS, grouped_swiglu, regime

    splits, D, F_ = SMALL_SHARED_CASES[table]
    assert regime(sum(splits), len(splits)) == table
    inputs = make_inputs(splits, D, F_, seed=len(table))
    got = run(lambda *args: grouped_swiglu(*args, configs=SMALL_SHARED_CONFIGS, use_tma=False), *inputs)
    assert_matches(got, reference_f64(inputs[0], splits, *inputs[2:]), splits, FP32_REL_TOL, table)


@interpreter_only
@pytest.mark.parametrize("total,programs,k_blocks,limit,expected", [
    (160, 132, 7, 4, (132, 112)),  # 28 tiles left for the second round: 4 programs each
    (224, 132, 7, 4, (132, 132)),  # 92 left: all programs, 0.7 of a tile each
    (16, 132, 7, 4, (0, 64)),      # one part-empty round: all of it streamed, at most 4 programs a tile
    (16, 132, 2, 8, (0, 32)),      # never a piece of less than one step
    (128, 132, 7, 4, (128, 0)),    # a round 7/8 full or more: not streamed
    (264, 132, 7, 4, (264, 0)),    # whole rounds
    (5, 3, 3, 4, (3, 3)),          # a program's steps run across two tiles
])
def test_interpreter_stream_k_schedule(total, programs, k_blocks, limit, expected):
    """`stream_k`'s plan and shares: only a last round at most 7/8 full is streamed, over at
    most `limit` programs a tile; every step of its tiles is taken by exactly one program,
    programs take consecutive steps in order, a tile is in at most limit + 1 pieces, and
    no two pieces leave their sums in one slot."""
    out = torch.zeros(2, dtype=torch.int32)
    owner = torch.zeros(max(1, (total - expected[0]) * k_blocks), dtype=torch.int32)
    slots = torch.zeros(2 * programs, dtype=torch.int32)
    _stream_k_probe[(programs,)](out, owner, slots, total, k_blocks, LIMIT=limit)
    assert tuple(out.tolist()) == expected
    assert slots.max() <= 1, "two pieces' partial sums in one scratch slot"
    whole, streams = expected
    if streams:
        taken = owner.tolist()
        assert taken == sorted(taken) and taken[0] == 1 and taken[-1] == streams, "every step once, in order"
        assert set(taken) == set(range(1, streams + 1))
        per_tile = [len(set(taken[t * k_blocks:(t + 1) * k_blocks])) for t in range(total - whole)]
        assert max(per_tile) <= limit + 1
    else:
        assert not owner.any()


@interpreter_only
@pytest.mark.parametrize("splits", [[21, 0, 0, 34, 1], [0, 0]])
def test_interpreter_recomputing_the_hidden_rows_changes_nothing(splits):
    """keep_hidden=False (selective recompute inside the op) keeps only the inputs and runs
    the gate_up GEMM again in the backward: the same kernels, so the same numbers, bit for
    bit, and a second backward through one forward is fine, since nothing saved is consumed."""
    from te_mixtral.experts.kernels.grouped_swiglu import grouped_swiglu

    x, counts, gate_up, down, dy = make_inputs(splits, 20, 36, seed=3)
    kept, recomputed = (run(lambda *a, keep=keep: grouped_swiglu(*a, keep_hidden=keep),
                            x, counts, gate_up, down, dy) for keep in (True, False))
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    gate_up.requires_grad_()
    y = grouped_swiglu(x, counts, gate_up, down, keep_hidden=False)
    first = torch.autograd.grad(y, gate_up, dy, retain_graph=True)[0]
    assert torch.equal(first, torch.autograd.grad(y, gate_up, dy)[0])


@interpreter_only
def test_interpreter_no_rows_and_backward_twice():
    from te_mixtral.experts.kernels.grouped_swiglu import grouped_swiglu

    x, counts, gate_up, down, _ = make_inputs([0, 0], 16, 16, seed=1)
    y, dx, d_gate_up, d_down = run(grouped_swiglu, x, counts, gate_up, down, torch.empty(0, 16))
    assert y.shape == (0, 16) and torch.equal(d_down, torch.zeros_like(d_down))

    # The backward overwrites the saved pre-activations with their gradient: a second
    # backward through the same forward must fail loudly, not return wrong numbers.
    x, counts, gate_up, down, dy = make_inputs([3, 2], 16, 16, seed=2)
    gate_up.requires_grad_()
    y = grouped_swiglu(x, counts, gate_up, down)
    y.backward(dy, retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        y.backward(dy)


@pytest.mark.slow
@interpreter_only
def test_interpreter_micro_batches_add_into_grad(monkeypatch):
    from expert_reference import check_micro_batches_add_into_grad

    from te_mixtral.experts.kernels.grouped_swiglu import grouped_swiglu

    # The tile an fp32 run takes (several to a weight gradient, and several K steps): the sum
    # is made in the weight-gradient kernel's epilogue, whatever the tile; the small tiles'
    # paths are test_interpreter_kernels_match_float64's.
    batches = [make_inputs(splits, 20, 36, seed) for seed, splits in enumerate(([21, 0, 0, 34, 1], [4, 9, 0, 0, 30],
                                                                                 [0, 0, 0, 0, 0], [1, 2, 3, 4, 5]))]
    check_micro_batches_add_into_grad(grouped_swiglu,
                                      [(x, counts, dy) for x, counts, _, _, dy in batches],
                                      batches[0][2], batches[0][3], monkeypatch)


@interpreter_only
@pytest.mark.parametrize("targets", [("gate_up", "down"), ("down",)], ids=["both", "down"])
@pytest.mark.parametrize("splits", [[21, 0, 0, 34, 1], [0, 0]], ids=["uneven", "no_rows"])
# F = 70: wider than one column tile, and a width grouped_mm pads (its d(act) share then
# comes back as a strided view, which the epilogue must not read as if contiguous).
@pytest.mark.parametrize("F_", some_slow([36, 70], [70]))
def test_interpreter_kernels_with_adapters_match_float64(targets, splits, F_):
    """LoRA through the Triton op: the gate_up delta added in the first epilogue, the down
    adapter's A applied to act inside the op and its share of d(act) added in the SwiGLU
    gradient's epilogue; the frozen base gets no gradient."""
    from expert_reference import random_adapters, reference_lora_f64
    from experts.test_adapters import assert_close, run_with_adapters

    from te_mixtral.experts.custom_grouped import kernels_swiglu

    x, counts, gate_up, down, dy = make_inputs(splits, 20, F_, seed=9)
    pairs = random_adapters(splits, 20, F_, rank=3, seed=4, targets=targets)
    got = run_with_adapters(kernels_swiglu, x, counts, gate_up, down, pairs, 0.9, dy)
    want = reference_lora_f64(x, splits, gate_up, down, pairs, 0.9, dy)
    if sum(splits) == 0:
        assert all(torch.equal(g, torch.zeros_like(g)) for g in got[1:])
    else:
        assert_close(got, want, f"kernels {targets}")


@interpreter_only
@pytest.mark.parametrize("targets", some_slow([("gate_up", "down"), ("gate_up",), ("down",)],
                                               [("gate_up",), ("down",)]), ids=["both", "gate_up", "down"])
@pytest.mark.parametrize("splits", [[21, 0, 0, 34, 1], [0, 0]], ids=["uneven", "no_rows"])
def test_interpreter_recompute_with_adapters_changes_nothing(targets, splits):
    """Selective recompute inside the op with LoRA's adapters: the gate_up adapter's delta is
    made again in the backward from its rank-r factors, so y and the gradients of x and of
    every A and B equal the kept op's bit for bit."""
    from expert_reference import random_adapters
    from experts.test_adapters import run_with_adapters

    from te_mixtral.experts.custom_grouped import kernels_swiglu

    x, counts, gate_up, down, dy = make_inputs(splits, 20, 36, seed=12)
    pairs = random_adapters(splits, 20, 36, rank=3, seed=6, targets=targets)
    kept, recomputed = (run_with_adapters(lambda *a, keep=keep: kernels_swiglu(*a, keep_hidden=keep),
                                          x, counts, gate_up, down, pairs, 0.9, dy) for keep in (True, False))
    assert len(kept) == len(recomputed) == 2 + 2 * len(targets)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)



def padded(inputs, extra: int):
    """`inputs` with `extra` rows of NaN after the real ones (and zeros in dy there): what the
    padded exchange hands the tier (distributed/dispatch.py), made as hostile as it can be."""
    x, counts, gate_up, down, dy = inputs
    return (torch.cat([x, torch.full((extra, x.shape[1]), float("nan"))]), counts, gate_up, down,
            torch.cat([dy, torch.zeros(extra, dy.shape[1])]))


def assert_padding_changes_nothing(fn, inputs, what):
    """Every result of the real rows, bit for bit, as without the padding rows."""
    rows = inputs[0].shape[0]
    want = run(fn, *inputs)
    got = run(fn, *padded(inputs, 7))
    for name, a, b in zip(("y", "dx", "d_gate_up", "d_down"), got, want):
        a = a[:rows] if name in ("y", "dx") else a
        assert torch.equal(a, b), f"{what}: {name} changed by rows past the last expert's"


@pytest.mark.parametrize("splits", [[5, 0, 7], [0, 0, 0]])
def test_cpu_path_takes_padded_rows(splits):
    tier = make_tier("custom_grouped")
    assert tier.takes_padded_rows
    assert_padding_changes_nothing(tier, make_inputs(splits, 20, 36, seed=5), "grouped_mm path")


@interpreter_only
@pytest.mark.parametrize("keep_hidden", some_slow([True, False], [False]), ids=["kept", "recomputed"])
def test_interpreter_kernels_take_padded_rows(keep_hidden):
    """The kernels schedule from the device-side split sizes and never touch a row past them:
    NaN there leaves every real result, and the weight gradients, exactly as they were."""
    from te_mixtral.experts.custom_grouped import kernels_swiglu

    def fn(*args):
        return kernels_swiglu(*args, keep_hidden=keep_hidden)

    assert_padding_changes_nothing(fn, make_inputs([21, 0, 0, 34, 1], 20, 36, seed=7), "kernels")
