"""Expert-load ratios (te_mixtral/measure/expert_load.py) against hand-computed cases."""

import pytest
import torch

from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.measure.expert_load import (
    busiest_over_mean,
    ep_sizes,
    load_line,
    step_record,
)


def test_busiest_over_mean_is_taken_layer_by_layer():
    counts_YE = torch.tensor([[6, 2, 2, 2],    # layer 0: expert 0 busiest; ranks of 2 experts: 8 vs 4
                              [3, 3, 3, 3]])   # layer 1: balanced
    # Experts: (6 + 3) / (3 + 3); ranks at EP=2: (8 + 6) / (6 + 6).
    assert busiest_over_mean(counts_YE, 4) == pytest.approx(9 / 6)
    assert busiest_over_mean(counts_YE, 2) == pytest.approx(14 / 12)
    # Summing the layers first would hide layer 0's imbalance behind layer 1's; here each
    # layer's busiest rank counts, as each layer's all-to-all waits for it.
    assert busiest_over_mean(torch.tensor([[4, 0], [0, 4]]), 2) == pytest.approx(2.0)


def test_step_record_and_line():
    assert ep_sizes(8) == [2, 4] and ep_sizes(6) == [2, 3] and ep_sizes(5) == []
    record = step_record(2.5, 0.75, torch.tensor([[5, 1, 1, 1, 1, 1, 1, 1]]), ExpertPlacement(4))
    assert record["max_over_mean"] == pytest.approx(5 / 1.5)
    assert record["busiest_rank_over_mean"] == {"2": pytest.approx(8 / 6), "4": pytest.approx(6 / 3)}
    line = load_line(record, ep_size=4)
    assert "max/mean 3.33" in line and "busiest rank/mean: this run's EP=4 2.00; were it split: EP=2 1.33" in line


def test_a_run_not_split_so_shows_the_ep_sizes_as_if():
    # Before, an EP=1 run printed "busiest rank/mean EP=2 1.33  EP=4 2.00", read as an EP=2 run's.
    record = step_record(2.5, 0.75, torch.tensor([[5, 1, 1, 1, 1, 1, 1, 1]]), ExpertPlacement(4))
    line = load_line(record, ep_size=1)
    assert line.endswith("busiest rank/mean, were it split: EP=2 1.33, EP=4 2.00") and "this run" not in line
    assert load_line(record, ep_size=8).endswith("were it split: EP=2 1.33, EP=4 2.00")  # one expert a rank


def test_the_runs_own_ep_size_is_met_as_its_experts_are_placed():
    tokens_YE = torch.tensor([[5, 4, 1, 1, 1, 1, 1, 1]])
    placed = ExpertPlacement.by_load(tokens_YE, 4)  # (5, 1) (4, 1) (1, 1) (1, 1): busiest 6 of mean 3.75
    record = step_record(2.5, 0.75, tokens_YE, placed)
    # The run's EP=4 as placed; EP=2, which it did not run at, in order: (5+4+1+1) of 7.5.
    assert record["busiest_rank_over_mean"] == {"2": pytest.approx(11 / 7.5), "4": pytest.approx(6 / 3.75)}
    assert step_record(2.5, 0.75, tokens_YE, ExpertPlacement(4))["busiest_rank_over_mean"]["4"] == pytest.approx(9 / 3.75)
