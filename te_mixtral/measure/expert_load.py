"""Expert load: how evenly the router spread a step's tokens over the experts, and over the
ranks that hold them.

Shape suffixes: see te_mixtral/__init__.py.

Everything here is computed from counts the router losses have already all-reduced: the
global batch's top-k picks per layer and expert (te_mixtral/model/router_losses.py), summed
over a step's micro-batches. No extra forward, no extra collective.

    max/mean                    the busiest expert's rows over the mean expert's
    busiest rank/mean at EP=P   the rows of the busiest of P ranks over the mean rank's, each
                                rank holding E/P consecutive experts as an EP group of P
                                places them in order; given for every P that divides E
                                (1 < P < E), so one run shows what EP=2, 4 ... would have
                                met (said so: only the run's own EP size's is what it met,
                                with its experts placed as the run placed them:
                                te_mixtral/distributed/placement.py)

Both are taken layer by layer and then summed: each layer's all-to-all waits for its
busiest rank, so a step pays the sum over layers of the busiest rank's rows, and the ratio
is that sum over the sum of the means (1: perfect balance; P: one rank gets everything).
With expert replicas (world = replicas x EP) the counts are every replica's, summed, so the
ratio is that of the summed load per rank position, at most the busiest single rank's; the
rows each rank received in one step are in --profile_phases' `expert_rows_per_rank`.
"""

import json
from pathlib import Path

import torch

from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.errors import UserError


def busiest_over_mean(tokens_per_expert_YE: torch.Tensor, groups: int) -> float:
    """Sum over layers of the busiest group's rows over the sum of the mean group's, the E
    experts cut into `groups` groups of consecutive experts, one per rank of an EP group of
    P = `groups` (see the module docstring)."""
    return rank_ratio(ExpertPlacement(groups).rows(tokens_per_expert_YE))


def rank_ratio(rows_YP: torch.Tensor) -> float:
    """Sum over layers of the busiest rank's rows over the sum of the mean rank's, from the
    rows each of P ranks gets in each layer, [Y, P] (however the experts are placed)."""
    rows_YP = rows_YP.double()
    return (rows_YP.amax(-1).sum() / rows_YP.mean(-1).sum()).item()


def ep_sizes(num_experts: int) -> list[int]:
    """The EP sizes the load is shown for: those that split the experts over 2 to E-1 ranks."""
    return [p for p in range(2, num_experts) if num_experts % p == 0]


def step_record(aux: float, z: float, tokens_per_expert_YE: torch.Tensor, placement: ExpertPlacement) -> dict:
    """One step's router losses (global) and expert load, as the training state keeps it; the
    run's own EP size's with the experts as `placement` placed them."""
    num_experts = tokens_per_expert_YE.shape[1]
    placed = {p: placement if p == placement.ep_size else ExpertPlacement(p) for p in ep_sizes(num_experts)}
    return {"aux": aux, "z": z, "max_over_mean": busiest_over_mean(tokens_per_expert_YE, num_experts),
            "busiest_rank_over_mean": {str(p): rank_ratio(placed[p].rows(tokens_per_expert_YE)) for p in placed}}


def busiest_ranks_text(busiest: dict[str, str], ep_size: int) -> str:
    """The busiest rank's ratios, {EP size: ratio as shown}, said as what they are: the run's own
    EP size's (met), and the others' (what the run would have met were it split so), which on
    an EP=1 run are all of them; '' where no EP size splits the experts."""
    own = busiest.get(str(ep_size))
    others = ", ".join(f"EP={p} {busiest[p]}" for p in sorted(busiest, key=int) if int(p) != ep_size)
    if own is None:
        return f"busiest rank/mean, were it split: {others}" if others else ""
    return f"busiest rank/mean: this run's EP={ep_size} {own}" + (f"; were it split: {others}" if others else "")


def load_line(record: dict, ep_size: int) -> str:
    """The console line of a logged step."""
    ranks = busiest_ranks_text({p: f"{r:.2f}" for p, r in record["busiest_rank_over_mean"].items()}, ep_size)
    return (f"    router: z-loss {record['z']:.4g}  experts max/mean {record['max_over_mean']:.2f}"
            + (f"  {ranks}" if ranks else ""))


def results_entries(records: list[dict], tokens_per_expert_YE: torch.Tensor | None, steps: tuple[int, int],
                    placement: ExpertPlacement | None = None) -> dict:
    """What results.json keeps: per step the aux loss, the z-loss (both global, unweighted)
    and the load ratios; the tokens per layer and expert summed over `steps` (first and last
    step, counted from 1: the steps this process ran), for the results page's heatmap; and
    each layer's experts slot by slot where `placement` placed them by load on several ranks."""
    if not records:
        return {}
    load = {"max_over_mean": [r["max_over_mean"] for r in records],
            "busiest_rank_over_mean": {p: [r["busiest_rank_over_mean"][p] for r in records]
                                       for p in records[-1]["busiest_rank_over_mean"]}}
    if tokens_per_expert_YE is not None:
        load["tokens_per_expert"] = tokens_per_expert_YE.tolist()
        load["tokens_per_expert_steps"] = list(steps)
    if placement is not None and placement.placed and placement.ep_size > 1:  # one rank: no balance to place for
        load["placement"] = placement.record()
    return {"aux_losses": [r["aux"] for r in records], "z_losses": [r["z"] for r in records], "expert_load": load}


def recorded_load(results_file: str | Path) -> torch.Tensor:
    """The tokens per layer and expert a run's results.json recorded (`results_entries`),
    [Y, E] in float64; a one-line `UserError` where the file holds none, naming the key that
    gave it (`ep_placement`), as other files' refusals name theirs."""
    named = f"ep_placement {results_file}"
    try:
        load = json.loads(Path(results_file).read_text())["expert_load"]["tokens_per_expert"]
    except OSError as e:
        raise UserError(f"cannot read {named}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"{named} holds no expert_load.tokens_per_expert, the tokens per layer and expert a "
                        f"training run's results.json records") from None
    try:  # rows of unequal length, or not numbers: no table
        tokens_YE = torch.tensor(load, dtype=torch.float64)
    except (ValueError, TypeError):
        tokens_YE = torch.empty(0)
    if tokens_YE.dim() != 2 or not (torch.isfinite(tokens_YE).all() and (tokens_YE >= 0).all()):
        raise UserError(f"{named}: expert_load.tokens_per_expert is not a table of token counts, one row a "
                        f"layer and one column an expert")
    return tokens_YE


def placement_by_recorded_load(results_file: str | Path, num_layers: int, num_experts: int,
                               ep_size: int) -> ExpertPlacement:
    """The experts placed by the load a run's results.json recorded (`ep_placement`), which must
    be that of a model of as many layers and experts."""
    tokens_YE = recorded_load(results_file)
    if tuple(tokens_YE.shape) != (num_layers, num_experts):
        raise UserError(f"ep_placement {results_file} recorded the load of {tokens_YE.shape[0]} layers of "
                        f"{tokens_YE.shape[1]} experts; this model has {num_layers} layers of {num_experts}: give "
                        f"the results.json of a run of this model")
    return ExpertPlacement.by_load(tokens_YE, ep_size)
