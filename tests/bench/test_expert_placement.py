"""The expert placement benchmark: by-load placement against every placement there is (two
experts a rank), a hand case, and the CLI on a results.json and on a file without loads."""

import itertools
import json

import pytest
import torch

from benchmarks import expert_placement as ep


def best_over_every_placement(tokens_E: list[float], ranks: int) -> float:
    """The smallest busiest rank's rows over all ways of putting E/ranks experts on each rank."""
    room, best = len(tokens_E) // ranks, float("inf")
    for order in itertools.permutations(range(len(tokens_E))):
        best = min(best, max(sum(tokens_E[e] for e in order[r * room:(r + 1) * room]) for r in range(ranks)))
    return best


def test_two_experts_a_rank_placed_by_load_is_the_best_placement():
    generator = torch.Generator().manual_seed(torch.seed())
    tokens_YE = torch.randint(0, 5000, (6, 8), generator=generator).double()
    rows_YP = ep.placed_by_load(tokens_YE, 4)
    assert torch.equal(rows_YP.sum(-1), tokens_YE.sum(-1))  # every row placed once
    for layer in range(6):
        assert rows_YP[layer].max().item() == best_over_every_placement(tokens_YE[layer].tolist(), 4)


def test_a_hand_case_and_the_ratio():
    # Consecutive: ranks (9+7, 1+1), busiest 16 of mean 9; by load: (9+1, 7+1), 10 of 9.
    tokens_YE = torch.tensor([[9.0, 7.0, 1.0, 1.0]])
    assert ep.placed_busiest_over_mean(tokens_YE, 2) == pytest.approx(10 / 9)
    assert ep.compare("run", {"tokens_per_expert": tokens_YE.tolist()})["by_ep"] == {
        2: {"consecutive": pytest.approx(16 / 9), "by_load": pytest.approx(10 / 9), "consecutive_per_step": None}}


def test_the_command_line_reads_runs_and_refuses_a_file_without_loads(tmp_path, capsys):
    run = tmp_path / "results.json"
    run.write_text(json.dumps({"expert_load": {"tokens_per_expert": [[9, 7, 1, 1], [4, 4, 4, 4]],
                                               "tokens_per_expert_steps": [1, 3],
                                               "busiest_rank_over_mean": {"2": [1.5, 1.25]}}}))
    out = tmp_path / "placement.json"
    assert ep.main([str(run), "--json", str(out)]) == 0
    assert "EP=2 1.412 -> 1.059 (1.375)" in capsys.readouterr().out  # (16 + 8) / (9 + 8) -> (10 + 8) / (9 + 8)
    assert json.loads(out.read_text())["runs"][0]["steps"] == [1, 3]
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"summary": {}}))
    assert ep.main([str(run), str(other)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"expert_placement: {other} holds no expert_load.tokens_per_expert (a training run of an MoE model writes it)"]
