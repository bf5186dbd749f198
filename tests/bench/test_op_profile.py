"""The op profile's step and host profile on the CPU (its kernel table needs a GPU): a step is
fwd+bwd then the optimizer's step, and the host profile counts per step."""

import torch

from benchmarks.op_profile import CPROFILE_STEPS, host_profile, make_step
from te_mixtral.experts.custom_grouped import grouped_mm_swiglu


def test_a_step_is_fwd_bwd_then_the_optimizer_step():
    generator = torch.Generator().manual_seed(0)
    sizes, D, F = [3, 5], 16, 24
    x = torch.randn(8, D, generator=generator, requires_grad=True)
    w1 = torch.randn(2, 2 * F, D, generator=generator, requires_grad=True)
    w2 = torch.randn(2, D, F, generator=generator, requires_grad=True)
    dy = torch.randn(8, D, generator=generator)
    seen, stepped = [], []

    def op(x, counts, w1, w2):
        seen.append(x)
        return grouped_mm_swiglu(x, counts, w1, w2)

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)
    optimizer.register_step_post_hook(lambda *_: stepped.append(len(seen)))
    inputs = (x, torch.tensor(sizes), w1, w2, dy)
    make_step(op, inputs, optimizer)()
    make_step(op, inputs, optimizer)()
    make_step(op, inputs, None)()
    assert len(seen) == 3 and stepped == [1, 2]  # each optimizer step after its fwd+bwd

    rows = host_profile(make_step(op, inputs, None), torch.device("cpu"), top=10**6)
    assert len(seen) == 3 + CPROFILE_STEPS
    mine = [r for r in rows if r["function"].startswith("test_op_profile.py:") and r["function"].endswith("(op)")]
    assert len(mine) == 1 and mine[0]["calls"] == 1  # per step
    assert [r["own_ms"] for r in rows] == sorted((r["own_ms"] for r in rows), reverse=True)
    assert all(r["cum_ms"] >= r["own_ms"] for r in rows)


def test_a_tile_table_it_does_not_know_is_refused_before_the_gpu_is_asked(capsys):
    from benchmarks.op_profile import main

    assert main(["--tiles", "medium", "--tiles", "nope"]) == 2
    assert "op_profile: error: no tile table 'nope'; the tables are" in capsys.readouterr().err


def test_each_op_runs_the_tile_table_its_gemm_table_reads():
    """ours: the table `regime` picks (bf16_configs'); "custom_grouped, NAME": NAME's, as
    `with_table` runs it; the peers: none."""
    from benchmarks.custom_grouped_ops import table_at
    from benchmarks.op_profile import our_table
    from te_mixtral.experts.kernels.grouped_swiglu import CONFIGS

    cpu = torch.device("cpu")
    assert our_table("custom_grouped", [64, 64], cpu) is CONFIGS["few rows, 64"]
    assert our_table("custom_grouped", [128, 128], cpu) is CONFIGS["two row tiles"]
    assert our_table("custom_grouped", [128] * 4, cpu) is CONFIGS["medium, few rows"]
    assert our_table("custom_grouped, previous", [64, 64], cpu) == table_at("previous", 128, 2)
    assert our_table("custom_grouped, previous", [64, 64], cpu) != CONFIGS["few rows, 64"]
    assert our_table("custom_grouped, medium, few rows", [128, 128], cpu) is CONFIGS["medium, few rows"]
    assert our_table("TE", [128, 128], cpu) is None and our_table("grouped_mm", [64], cpu) is None


def test_cases_from_a_splits_file_are_the_last_steps_layers(tmp_path, capsys):
    from benchmarks.op_profile import cases_from, main

    path = tmp_path / "splits.json"
    path.write_text('{"steps": [[[1, 2], [3, 4]], [[5, 0], [7, 8]]]}')
    assert cases_from(path) == {"layer 0": [5, 0], "layer 1": [7, 8]}
    for bad in ('{"steps": []}', '{"steps": [[[1, -2]]]}', '{"layers": 1}', "not json"):
        path.write_text(bad)
        assert main(["--cases-from", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"op_profile: error: --cases-from {path}") and err.count("\n") == 1


def test_totals_sum_each_ops_cases_and_gemms(capsys):
    from benchmarks.op_profile import print_totals, totals

    def case(op, step, gemms):
        return {"op": op, "step_ms": step, "gpu_ms": step / 2,
                "gemms": {"gemms": [{"gemm": g, "busy_ms": ms} for g, ms in gemms.items()]}}

    results = [case("TE", 2.0, {"gate_up": 1.0, "down": 0.5}), case("TE", 4.0, {"gate_up": 2.0, "down": 0.25}),
               case("custom_grouped", 3.0, {"gate_up": 1.5}), {"op": "TE", "skipped": "no TE"}]
    found = totals(results)
    assert found["TE"] == {"cases": 2, "step_ms": 6.0, "gpu_ms": 3.0, "gemms": {"gate_up": 3.0, "down": 0.75}}
    assert found["custom_grouped"]["cases"] == 1
    print_totals(found)
    assert "TE               2 cases  6.00 / 3.00  GEMMs 3.75: gate_up 3.00  down 0.75" in capsys.readouterr().out
