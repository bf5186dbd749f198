"""gemm_floors.py on the CPU: launches split into steps and into the six GEMMs as each op
launches them, each GEMM's busy time and floors, and ours' grid as its launchers ask it."""

import random

import pytest
import torch

from benchmarks import gemm_floors
from benchmarks.custom_grouped_ops import OPS
from te_mixtral.experts.kernels import grouped_gemm, wgrad_gemm
from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS, grouped_swiglu

SPLIT_K = "void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>"
LAYOUTS = {"gate_up": "TN", "down": "TN", "down_dgrad": "NN", "down_wgrad": "NT", "gate_up_dgrad": "NN",
           "gate_up_wgrad": "NT"}


def te_like_step(experts: int) -> list[tuple[str, str]]:
    """A TE-like step as (kernel, GEMM it belongs to): a cuBLAS GEMM an expert, named by its
    layout, a split-K reduction after the data gradients' GEMMs, a memset before each of them,
    SwiGLU and a cast between."""
    step = []
    for op in OPS:
        if op.endswith("dgrad"):
            step.append(("Memset (Device)", "other"))
        for _ in range(experts):
            step.append((f"nvjet_sm90_tst_192x64_64x6_2x1_v_bz_{LAYOUTS[op]}T", op))
            if op.endswith("dgrad"):
                step.append((SPLIT_K, op))
        if op == "gate_up":
            step.append(("void at::native::elementwise_kernel<silu_kernel>", "other"))
        if op == "down":
            step.append(("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", "other"))
    return step


def launches_of(steps: list[list[str]], seed: int) -> list[dict]:
    """Launch records for `steps` of kernel names: correlation ids in launch order, start
    times in launch order across steps but shuffled inside each step (kernels that ran on
    other streams), each step after the one before."""
    rng, launches, order, clock = random.Random(seed), [], 100, 0.0
    for names in steps:
        starts = [clock + rng.uniform(0, 50) for _ in names]
        for name, start in zip(names, starts):
            order += 1 + rng.randrange(3)  # ids grow with each launch, not always by one
            launches.append({"name": name, "order": order, "start_us": start, "end_us": start + 10.0, "ctas": 132,
                             "registers": 168, "shared_bytes": 49152, "occupancy_pct": 18.75})
        clock = max(starts) + 100.0
    rng.shuffle(launches)
    return launches


@pytest.mark.parametrize("experts", [1, 4])
def test_a_te_like_step_falls_into_its_six_gemms_with_their_split_k_reductions(experts):
    step = te_like_step(experts)
    steps = gemm_floors.by_step(launches_of([[name for name, _ in step]] * 3, seed=experts), 3)
    assert len(steps) == 3
    for got in steps:
        assert [k["name"] for k in got] == [name for name, _ in step]  # launch order, not start order
        found = gemm_floors.by_gemm(got)
        assert {op: [k["name"] for k in ks] for op, ks in found.items()} == {
            op: [name for name, owner in step if owner == op] for op in (*OPS, "other")}
        assert all(LAYOUTS[op] + "T" in k["name"] for op in OPS for k in found[op] if "nvjet" in k["name"])


def test_grouped_mms_set_up_kernels_are_no_gemm_of_their_own():
    gemm = "cutlass::device_kernel<GemmUniversal<GroupProblemShape>>"
    step = [name for _ in OPS for name in ("void at::cuda::detail::prepare_grouped_gemm_data<bf16>", gemm)]
    found = gemm_floors.by_gemm([{"name": name, "order": i + 1} for i, name in enumerate(step)])
    assert all(len(found[op]) == 1 and found[op][0]["name"] == gemm for op in OPS)
    assert len(found["other"]) == len(OPS)


def test_steps_or_gemms_that_do_not_split_are_refused():
    with pytest.raises(ValueError, match="do not make 3 equal steps"):
        gemm_floors.by_step(launches_of([["_rows_gemm"] * 6, ["_rows_gemm"] * 5], seed=0), 3)
    with pytest.raises(ValueError, match="did not launch the same kernels"):
        gemm_floors.by_step(launches_of([["_rows_gemm"] * 6, ["_wgrad_gemm"] * 6], seed=0), 2)
    with pytest.raises(ValueError, match="5 GEMM kernels a step do not make the 6 GEMMs"):
        gemm_floors.by_gemm([{"name": "_rows_gemm", "order": i} for i in range(5)])


def test_a_gemms_busy_time_counts_kernels_side_by_side_once_and_gaps_not_at_all():
    """Two experts' GEMMs overlapping (0-30 and 20-50 us) then one after a gap (70-80): busy
    60 us, summed 70, span 80; its floors from its own bytes and FLOPs."""
    sizes, D, F = [64, 64], 256, 512
    intervals = {"gate_up": [(0, 30), (20, 50), (70, 80)]}
    step, order = [], 0
    for op in OPS:
        for start, end in intervals.get(op, [(0, 1)] * 3):
            order += 1
            step.append({"name": "nvjet_gemm", "order": order, "start_us": start, "end_us": end, "ctas": 264,
                         "registers": 222, "shared_bytes": 98304, "occupancy_pct": 12.5})
    found = gemm_floors.gemm_table([step], sizes, D, F, bandwidth_gbs=2000.0, tflops=500.0, sms=132)
    row = found["gemms"][0]
    assert row["gemm"] == "gate_up" and row["launches"] == 3
    assert (row["ctas"], row["registers"], row["shared_bytes"], row["occupancy_pct"]) == ([264], [222], [98304], [12.5])
    assert (row["busy_ms"], row["kernel_ms"], row["span_ms"]) == pytest.approx((0.060, 0.070, 0.080))
    R = sum(sizes)
    nbytes = 2 * (R * D + 2 * 2 * F * D + 3 * R * F)  # x and W1 read, h and act written
    assert row["bytes"] == nbytes and row["flops"] == 4 * R * D * F
    assert row["floor_ms"] == pytest.approx(nbytes / 2e12 * 1e3)
    compute_ms = 4 * R * D * F / 5e14 * 1e3
    assert row["x_floor"] == pytest.approx(0.060 / max(row["floor_ms"], compute_ms))
    assert row["x_sum"] == pytest.approx(0.060 / (row["floor_ms"] + compute_ms))
    assert "ours" not in row and found["other_launches"] == 0


@pytest.mark.parametrize("table,sizes", [("few rows, 64", [64, 64]), ("few rows, 64", [128, 128]),
                                         ("medium", [200, 312, 0])])
def test_ours_launches_its_gemms_in_order_on_the_grid_our_grid_gives(table, sizes, monkeypatch):
    """grouped_swiglu's fwd+bwd with its launches recorded (nothing runs): the kernels come in
    OPS' order, `_wgrad_gemm` for the weight gradients, each on the programs `our_grid` says
    for 132 SMs."""
    D, F, sms = 256, 512, 132
    launched = []

    def record(kernel, programs, target, *args, **kwargs):
        launched.append((kernel.__name__, programs))

    for module in (grouped_gemm, wgrad_gemm):
        monkeypatch.setattr(module, "launch", record)
        monkeypatch.setattr(module, "max_programs", lambda device: sms)
    L, R = len(sizes), sum(sizes)
    x = torch.zeros(R, D, dtype=torch.bfloat16, requires_grad=True)
    w1 = torch.zeros(L, 2 * F, D, dtype=torch.bfloat16, requires_grad=True)
    w2 = torch.zeros(L, D, F, dtype=torch.bfloat16, requires_grad=True)
    y = grouped_swiglu(x, torch.tensor(sizes), w1, w2, configs=dict.fromkeys(CONFIGS, CONFIGS[table]), use_tma=False)
    torch.autograd.grad(y, (x, w1, w2), torch.zeros_like(y))
    assert [name for name, _ in launched] == ["_wgrad_gemm" if op.endswith("wgrad") else "_rows_gemm" for op in OPS]
    grids = [gemm_floors.our_grid(op, CONFIGS[table][op], sizes, D, F, sms) for op in OPS]
    assert [programs for _, programs in launched] == [grid["programs"] for grid in grids]
    assert len({grid["programs"] for grid in grids}) > 1  # the shapes tell the GEMMs apart


def test_our_grid_counts_the_tiles_the_rows_make():
    """8x7B's down projection over 2 experts of 128 rows with 64 x 128 tiles: 2 row tiles an
    expert, 4096 / 128 column tiles, 14336 / 64 reduction steps; its weight gradient (4096 x
    14336 in 128 x 128 tiles) 2 steps of 64 rows."""
    table = CONFIGS["few rows, 64"]
    down = gemm_floors.our_grid("down", table["down"], [128, 128], 4096, 14336, sms=132)
    assert (down["tiles"], down["row_tiles"], down["k_steps"], down["programs"]) == (2 * 2 * 32, 2, 224, 264)
    assert down["rounds"] == pytest.approx(128 / 264)
    wgrad = gemm_floors.our_grid("down_wgrad", table["down_wgrad"], [128, 128], 4096, 14336, sms=132)
    assert (wgrad["tiles"], wgrad["row_tiles"], wgrad["k_steps"], wgrad["programs"]) == (2 * 32 * 112, None, 2, 264)


class _Event:
    """A profiler event's attributes as torch versions give them: `event_metadata` (typed), or
    the CUPTI record's JSON text."""

    def __init__(self, **attributes):
        vars(self).update(attributes)


def test_the_launch_record_is_read_from_either_form_torch_gives():
    typed = _Event(event_metadata=_Event(grid=[132, 2, 1], registers_per_thread=222, shared_memory=98304,
                                         est_occupancy_pct=12.5))
    text = _Event(metadata_json='"queued": 0, "stream": 7, "correlation": 812, "registers per thread": 222, '
                                '"shared memory": 98304, "blocks per SM": 2, "warps per SM": 8, "grid": [264, 1, 1], '
                                '"block": [128, 1, 1], "est. achieved occupancy %": 12.5')
    expected = {"ctas": 264, "registers": 222, "shared_bytes": 98304, "occupancy_pct": 12.5}
    assert gemm_floors.launch_record(typed) == expected and gemm_floors.launch_record(text) == expected
    nothing = dict.fromkeys(expected)
    assert gemm_floors.launch_record(_Event()) == nothing
    assert gemm_floors.launch_record(_Event(event_metadata=None)) == nothing
