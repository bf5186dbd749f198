"""The expert placement benchmark: a hand case, and the CLI on a results.json and on a file
without loads (the placement itself: tests/distributed/test_placement.py)."""

import json

import pytest
import torch

from benchmarks import expert_placement as ep


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
