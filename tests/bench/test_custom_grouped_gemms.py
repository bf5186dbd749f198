"""benchmarks/custom_grouped_gemms.py on a CPU: the tiles it tries and how it names them, the
`tile_config(...)` it prints for a table, the picks it makes from times, its tables (with a
GEMM's bytes floor), its JSON, some of the six GEMMs only (`--gemms`) and its refusals; and, run by Triton's interpreter (TRITON_INTERPRET=1, fp32, tiny shapes),
its check of each GEMM against torch, which a wrong or unwritten result fails before anything
is timed. The interpreter must be on before triton is first imported, so
`test_the_sweep_in_the_interpreter` runs this file's `test_interpreter_*` tests in a fresh
pytest (tests/README.md); run directly they are skipped."""

import json
import math
import os

import pytest
import torch
from background import assert_passed, interpreter_run
from conftest import interpreter_runs_reduced_loop_bounds

from benchmarks import custom_grouped_gemms as gemms
from benchmarks import custom_grouped_ops as cb
from te_mixtral.experts.kernels import grouped_swiglu as gs
from te_mixtral.experts.kernels.schedule import FP32_TILE, tile_config

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreter_only = pytest.mark.skipif(not INTERPRETING, reason="runs under TRITON_INTERPRET=1")

# The 8-layer step's rows (8 experts x 2048), a split as uneven as its router's, EP=2's and 16 experts'.
LARGE_CASES = ([2048] * 8, [3441, 2719, 2243, 1997, 1838, 1603, 1399, 1144], [4096] * 4, [1024] * 16)


def every_tile():
    """Every config of the shipped tables and of the sweeps' candidates."""
    tables = (gs.CONFIGS, gs.NF4_CONFIGS, gs.SMALL_SHARED_CONFIGS, gs.FP32_CONFIGS)
    yield from (c for family in tables for table in family.values() for c in table.values())
    yield from (c for regime in cb.CANDIDATES.values() for tiles in regime.values() for c in tiles)


def test_a_case_tries_its_tables_pick_first_and_hoppers_large_tiles():
    for sizes in LARGE_CASES:
        assert gs.regime(sum(sizes), len(sizes)) == "large"
        for op in cb.OPS:
            tiles, pick = gemms.case_tiles(op, sizes)
            assert next(iter(tiles)) == pick and tiles[pick] == gs.CONFIGS["large"][op]
            assert len(tiles) >= 10, op
    rows = gemms.case_tiles("down", LARGE_CASES[0])[0]
    wgrad = gemms.case_tiles("gate_up_wgrad", LARGE_CASES[0])[0]
    for tiles in (rows, wgrad):
        assert {(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_I"], c["num_warps"], c["num_stages"])
                for c in tiles.values()} >= {(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (256, 128, 64, 8, 4)}


def test_the_weight_gradients_try_their_table_and_every_other_candidate():
    """At 64 rows over 4 experts: the few-rows table's weight-gradient tile first, then each
    other candidate of its regime (those that hold three and four programs an SM among them),
    each under a name of its own, the table's own not twice."""
    table = gs.CONFIGS["few rows, 64"]["down_wgrad"]
    tiles, pick = gemms.case_tiles("down_wgrad", [64] * 4)
    assert next(iter(tiles.items())) == (pick, table)
    others = [c for c in cb.candidates("few rows, 64", "down_wgrad") if c != table]
    assert list(tiles.values())[1:] == others and len(tiles) == len(cb.WGRAD_FEW_ROWS)
    assert {c["PROGS_PER_SM"] for c in tiles.values()} >= {3, 4}


def test_a_tile_is_named_by_every_field_that_tells_it_apart():
    tiles = list(every_tile())
    assert len({gemms.tile_name(c) for c in tiles}) == len({json.dumps(c, sort_keys=True) for c in tiles})


def test_the_large_candidates_fit_hoppers_shared_memory():
    """What their comment says: each tile's pipeline (A and B tiles, gate_up's two B tiles, for
    each stage) asks at most 192 KiB, within the 227 a Hopper block gets."""
    for kind, tiles in cb.CANDIDATES["large"].items():
        b_tiles = 2 if kind == "gate_up" else 1
        for c in tiles:
            per_stage = (c["BLOCK_M"] + b_tiles * c["BLOCK_N"]) * c["BLOCK_I"] * 2
            assert c["num_stages"] * per_stage <= 192 * 1024, (kind, gemms.tile_name(c))


def test_a_tile_prints_as_the_call_that_makes_it():
    assert (gemms.tile_source(tile_config(128, 256, 64, 8, 3, group=16, flatten=True))
            == "tile_config(128, 256, 64, 8, 3, group=16, flatten=True)")
    assert gemms.tile_source(tile_config(128, 128, 64, 8, 4)) == "tile_config(128, 128, 64, 8, 4)"
    for c in every_tile():
        assert eval(gemms.tile_source(c), {"tile_config": tile_config}) == c


def fake_case(ms: dict[str, dict[str, float | str]], pick="A", flops=2e12, moved=3e9) -> dict:
    """A case's result as sweep_case returns it, every GEMM alike: ms {op: {tile: ms or why it
    failed}}, for the GEMMs it names; a bytes floor at 3000 GB/s."""
    configs = {name: tile_config(128, 64 * (i + 1), 64, 8, 3) for i, name in enumerate(next(iter(ms.values())))}
    ops = {}
    for op in ms:
        tiles = {name: {"config": configs[name], **({"failed": v} if isinstance(v, str) else
                                                    {"ms": v, "tflops": flops / v / 1e9, "error": 1e-3})}
                 for name, v in ms[op].items()}
        peers = {peer: {"ms": 2.0, "tflops": flops / 2.0 / 1e9} for peer in gemms.PEERS}
        for row in (*tiles.values(), *peers.values()):
            if "ms" in row and "ms" in tiles[pick]:
                row["x_table"] = tiles[pick]["ms"] / row["ms"]
        ops[op] = {"flops": flops, "bytes": moved, "floor_ms": moved / 3e9, "pick": pick, "tiles": tiles,
                   "peers": peers}
    return ops


def test_the_picks_change_a_tile_only_where_it_is_faster_in_every_case_by_the_margin():
    same = {"A": 2.0, "B": 2.0, "C": 2.0, "D": 2.0}
    one = fake_case({**dict.fromkeys(cb.OPS, same),
                     "down": {"A": 2.0, "B": 1.9, "C": 2.0, "D": 1.0},  # B: 5 % faster; D fails in the other case
                     "gate_up": {"A": 2.0, "B": 1.99, "C": 2.0, "D": 2.0},  # B: 0.5 %, under the margin
                     "down_wgrad": {"A": "OutOfResources: shared memory", "B": 2.1, "C": 2.0, "D": 2.2}})
    two = fake_case({**dict.fromkeys(cb.OPS, same),
                     "down": {"A": 2.0, "B": 1.9, "C": 2.0, "D": "wrong result: relative error 3.0e-01 > 1e-02"},
                     "gate_up": {"A": 2.0, "B": 1.99, "C": 2.0, "D": 2.0},
                     "down_wgrad": {"A": 2.0, "B": 2.1, "C": 2.0, "D": 2.2}})
    cases = {"8x2048": {"regime": "large", "ops": one}, "skewed": {"regime": "large", "ops": two}}
    picks = gemms.would_pick(cases, margin=0.02)["large"]
    assert picks["down"]["tile"] == "B" and picks["down"]["changed"]
    assert picks["down"]["ms"] == pytest.approx(3.8) and picks["down"]["table_ms"] == pytest.approx(4.0)
    assert picks["gate_up"]["tile"] == "A" and not picks["gate_up"]["changed"]
    assert picks["down_wgrad"]["tile"] == "C" and picks["down_wgrad"]["table_ms"] is None  # the table's failed
    assert picks["gate_up_dgrad"]["tile"] == "A"  # a tie keeps the table's
    assert gemms.would_pick(cases, margin=0.01)["large"]["down"]["tile"] == "B"


def test_the_tables_sums_picks_and_json(tmp_path):
    ops = fake_case({**dict.fromkeys(cb.OPS, {"A": 2.0, "B": 2.5, "C": "RuntimeError: out of resources"}),
                     "down": {"A": 2.0, "B": 1.6, "C": "not run: past --budget-s"}})
    lines = gemms.op_table([2048] * 8, "down", ops["down"])
    assert lines[0] == "=== 8x2048 down: the forward's down, 2.00 TFLOP, 3000.0 MB: bytes floor 1.000 ms"
    assert lines[2].split() == ["B", "1.600", "1250", "1.25", "1.0e-03"]  # fastest first, 2e12 FLOP / 1.6 ms
    assert lines[3].split() == ["A", "(table)", "2.000", "1000", "1.00", "1.0e-03"]
    assert lines[4].split()[:2] == ["C", "not"] and lines[4].endswith("past --budget-s")
    assert lines[5].split() == ["cuBLAS", "mm,", "plain", "GEMM", "2.000", "1000", "1.00"]
    sums = gemms.case_sums(ops)
    assert sums == {"table": 12.0, "fastest tiles": 11.6, "cuBLAS mm": 12.0, "grouped_mm": 12.0}
    lines = gemms.sums_lines([2048] * 8, ops, peak=1000.0)
    assert lines[2].split() == ["fastest", "tiles", "11.600", "ms", "1034", "TFLOP/s", "103.4%", "of", "the",
                                "matmul", "rate"]  # 12e12 FLOP / 11.6 ms
    cases = {"8x2048": {"sizes": [2048] * 8, "regime": "large", "ops": ops, "sums": sums}}
    picks = gemms.would_pick(cases, margin=0.02)
    # The printed table pastes into grouped_swiglu.CONFIGS as it is.
    printed = gemms.picks_lines(picks, cases, 0.02)
    assert printed[0].startswith('=== tile table "large" as this run picks it') and "8x2048" in printed[0]
    assert "2.000 -> 1.600 ms (-20.0%), was tile_config(" in printed[3]
    table = eval("{" + "\n".join(printed[1:]) + "}", {"tile_config": tile_config})
    assert table["large"] == {op: ops[op]["tiles"]["B" if op == "down" else "A"]["config"] for op in cb.OPS}
    args = gemms.argparse.Namespace(rounds=3, margin=0.02, gemms=",".join(cb.OPS))
    written = json.loads(json.dumps(gemms.payload({"device": "cpu"}, 730.0, cases, picks, args, 3000.0),
                                    allow_nan=False))
    assert written["copy_bandwidth_gbs"] == 3000.0 and written["gemms"] == list(cb.OPS)
    assert written["cases"]["8x2048"]["ops"]["down"]["floor_ms"] == 1.0
    assert written["would_pick"]["large"]["down"]["source"] == gemms.tile_source(ops["down"]["tiles"]["B"]["config"])
    assert written["cases"]["8x2048"]["ops"]["down"]["tiles"]["C"]["failed"] == "not run: past --budget-s"


def test_some_gemms_sum_as_themselves_and_pick_the_rest_as_the_table_has_them():
    """--gemms down_wgrad,gate_up_wgrad: the sums name the two, and the picks block still
    pastes as a whole table, the GEMMs not run at the table's own tiles."""
    wgrads = ("down_wgrad", "gate_up_wgrad")
    ops = fake_case({"down_wgrad": {"A": 2.0, "B": 1.0}, "gate_up_wgrad": {"A": 2.0, "B": 2.0}})
    assert gemms.sums_lines([64] * 4, ops, peak=1000.0)[0] == "=== 4x64: down_wgrad, gate_up_wgrad, 4.00 TFLOP"
    assert gemms.case_sums(ops)["fastest tiles"] == 3.0
    cases = {"4x64": {"sizes": [64] * 4, "regime": "few rows, 64", "ops": ops}}
    picks = gemms.would_pick(cases, margin=0.02)
    assert list(picks["few rows, 64"]) == list(wgrads) and picks["few rows, 64"]["down_wgrad"]["tile"] == "B"
    printed = gemms.picks_lines(picks, cases, 0.02)
    table = eval("{" + "\n".join(printed[1:]) + "}", {"tile_config": tile_config})["few rows, 64"]
    assert table == {**gs.CONFIGS["few rows, 64"], "down_wgrad": ops["down_wgrad"]["tiles"]["B"]["config"],
                     "gate_up_wgrad": ops["gate_up_wgrad"]["tiles"]["A"]["config"]}  # a tie keeps the pick
    assert sum(line.endswith("# the table's, not run") for line in printed) == len(cb.OPS) - len(wgrads)


@pytest.mark.parametrize("argv,says", [
    (["--gemms", "down_wgrad,up_wgrad"], "--gemms takes gate_up, down"),
    (["--gemms", "down,down"], "--gemms takes gate_up, down"),
    (["--cases", "8x"], "--cases takes LxR or R0+R1+..."),
    (["--cases", "0x2048"], "--cases takes LxR or R0+R1+..."),
    (["--cases", "8x2048,5+-1"], "--cases takes LxR or R0+R1+..."),
    (["--rounds", "0"], "--rounds takes 1 or more"),
    (["--margin", "1.5"], "--margin a fraction"),
])
def test_bad_arguments_get_one_line(argv, says, capsys):
    assert gemms.main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1


# --- the check, run by the interpreter in a fresh process ------------------------------

INTERPRETER_RUN = interpreter_run(__file__)
PLANNED_COMMANDS = [INTERPRETER_RUN]  # run from the session's start (conftest.py's planned_command)


@pytest.mark.slow
@pytest.mark.skipif(INTERPRETING, reason="this is the launcher")
@interpreter_runs_reduced_loop_bounds
def test_the_sweep_in_the_interpreter(planned_command):
    assert_passed(planned_command(INTERPRETER_RUN)[0], __file__)


# An uneven split with an empty expert; D and F make several row and column tiles of the small
# tile and several K steps, F a short last one.
SIZES, DIMS = [5, 0, 11], (32, 40)
SMALL = tile_config(16, 16, 16, 4, 1, parts=2)
STREAMED = tile_config(16, 16, 16, 4, 1, parts=2, tail_split=4)  # the row GEMMs' last round in pieces


def tiles_with(*configs) -> tuple[dict, dict]:
    """{op: {name: config}} of FP32_TILE (the pick) and `configs`, the weight gradients without
    a streamed one (they have no TAIL_SPLIT); {op: the pick's name}."""
    tiles = {op: {gemms.tile_name(c): c for c in (FP32_TILE, *configs) if "wgrad" not in op or c != STREAMED}
             for op in cb.OPS}
    return tiles, dict.fromkeys(cb.OPS, gemms.tile_name(FP32_TILE))


class Clock:
    """A timer that runs nothing: each launch it is handed takes 1, 2, 3, ... ms, in the order
    it was first handed, every time."""

    def __init__(self):
        self.timed, self.ms = [], {}

    def __call__(self, launch):
        self.timed.append(launch)
        return self.ms.setdefault(launch, float(len(self.ms) + 1))


@interpreter_only
def test_interpreter_every_gemm_passes_the_check_and_is_timed_beside_the_peers():
    tiles, picks = tiles_with(SMALL, STREAMED)
    clock, said = Clock(), []
    ops = gemms.sweep_case(SIZES, tiles, picks, timer=clock, dims=DIMS, dtype=torch.float32, device="cpu",
                           rounds=2, bandwidth_gbs=2.0, say=said.append)
    assert list(ops) == list(cb.OPS)
    for op, entry in ops.items():
        assert set(entry["tiles"]) == set(tiles[op]) and set(entry["peers"]) == set(gemms.PEERS)
        for row in (*entry["tiles"].values(), *entry["peers"].values()):
            assert "failed" not in row and row["ms"] in clock.ms.values()
        for row in entry["tiles"].values():
            assert row["error"] <= gemms.TOLERANCE[torch.float32], op
        assert entry["flops"] == cb.FLOP_UNITS[op] * sum(SIZES) * DIMS[0] * DIMS[1]
        assert entry["floor_ms"] == cb.gemm_bytes(op, SIZES, *DIMS) / 2e6  # bytes at 2 GB/s
        pick_ms = entry["tiles"][picks[op]]["ms"]
        assert all(row["x_table"] == pick_ms / row["ms"] for row in (*entry["tiles"].values(), *entry["peers"].values()))
    assert len(clock.timed) == 2 * sum(len(tiles[op]) + len(gemms.PEERS) for op in cb.OPS)  # rounds x (tiles + peers)
    assert sum(line.startswith("=== 5+0+11 ") for line in said) == len(cb.OPS)


@interpreter_only
def test_interpreter_some_gemms_run_those_only():
    """--gemms' sweep: a case whose `tiles` hold the weight gradients checks and times them alone."""
    tiles, picks = tiles_with(SMALL)
    wgrads = {op: tiles[op] for op in ("gate_up_wgrad", "down_wgrad")}
    clock = Clock()
    ops = gemms.sweep_case(SIZES, wgrads, picks, timer=clock, dims=DIMS, dtype=torch.float32, device="cpu",
                           rounds=1, say=lambda line: None)
    assert list(ops) == ["down_wgrad", "gate_up_wgrad"]  # in the op's order
    assert all(row["error"] <= gemms.TOLERANCE[torch.float32] for entry in ops.values() for row in entry["tiles"].values())
    assert ops["down_wgrad"]["floor_ms"] is None  # no bandwidth measured
    assert len(clock.timed) == 2 * (2 + len(gemms.PEERS))


@interpreter_only
def test_interpreter_a_wrong_or_unwritten_result_fails_the_check_and_is_not_timed(monkeypatch):
    """Tiles after a right one: one whose launch writes nothing (the right tile's results are
    still there: the check must not take them), one off by 1 % in the last expert's rows or
    weight gradient, one whose launch raises. Each is named with why, and none is timed."""
    nothing, off, raising = (tile_config(16, 16, 16, 4, 1, group=g) for g in (3, 5, 7))
    real = cb.gemm_call

    def gemm_call(op, t, c, use_tma):
        launch = real(op, t, c, use_tma)
        if c == nothing:
            return lambda: None
        if c == off:
            def off_by_one_percent():
                launch()
                for name in cb.GEMM_OUTPUTS[op]:
                    t[name][-1 if "wgrad" in op else slice(-SIZES[-1], None)] *= 1.01
            return off_by_one_percent
        if c == raising:
            def out_of_resources():
                raise RuntimeError("out of resource: shared memory, Required: 300000, Hardware limit: 232448\nmore")
            return out_of_resources
        return launch

    monkeypatch.setattr(cb, "gemm_call", gemm_call)
    tiles, picks = tiles_with(SMALL, nothing, off, raising)
    clock = Clock()
    ops = gemms.sweep_case(SIZES, tiles, picks, timer=clock, dims=DIMS, dtype=torch.float32, device="cpu",
                           rounds=1, say=lambda line: None)
    for op, entry in ops.items():
        rows = {c_name: entry["tiles"][c_name] for c_name in map(gemms.tile_name, (nothing, off, raising))}
        assert rows[gemms.tile_name(nothing)]["error"] is None  # NaN: the poison was never overwritten
        assert rows[gemms.tile_name(nothing)]["failed"] == "wrong result: relative error nan > 1e-05"
        assert rows[gemms.tile_name(off)]["failed"].startswith("wrong result") and 1e-3 < rows[
            gemms.tile_name(off)]["error"] <= 1e-2
        assert rows[gemms.tile_name(raising)]["failed"] == ("RuntimeError: out of resource: shared memory, "
                                                            "Required: 300000, Hardware limit: 232448")
        assert all("ms" not in row for row in rows.values())
        assert "ms" in entry["tiles"][gemms.tile_name(SMALL)], op
    assert len(clock.timed) == sum(2 + len(gemms.PEERS) for _ in cb.OPS)  # the pick, SMALL and the peers
    picks = gemms.would_pick({"case": {"regime": "large", "ops": ops}}, margin=0.0)["large"]
    assert {pick["tile"] for pick in picks.values()} <= {gemms.tile_name(FP32_TILE), gemms.tile_name(SMALL)}


def test_the_reference_is_the_gemm_itself():
    """The float64 reference against the op's own GEMMs where they are the plain ones the
    peers run (an independent path: grouped_mm), so a reference that computed the wrong GEMM
    would show."""
    t = cb.gemm_operands(SIZES, *DIMS, torch.float32, "cpu")
    for op in ("gate_up", "down", "down_wgrad", "gate_up_dgrad", "gate_up_wgrad"):
        plain = gemms.peer_calls(op, t, SIZES)["grouped_mm"]()
        want = gemms.reference(op, t)[0]
        assert torch.allclose(plain.double(), want, rtol=1e-5, atol=1e-5), op
    assert math.isnan(gemms.relative_error([torch.full((2, 3), math.nan)], [torch.ones(2, 3, dtype=torch.float64)]))
