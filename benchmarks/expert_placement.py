"""What placing the experts on the ranks by their load buys in rows: the busiest rank's rows
over the mean rank's, with each EP rank holding E/P consecutive experts (EP's default) and with
the experts placed layer by layer by the load a run recorded, as `ep_placement` places them.

Shape suffixes: see te_mixtral/__init__.py (Y layers, E experts).

Each MoE layer's all-to-all waits for its busiest rank, so a step pays, layer by layer, the
busiest rank's rows (te_mixtral/measure/expert_load.py). Which experts share a rank is a
choice: a heavy expert beside a light one evens the ranks out. This reads the tokens per
layer and expert that a run's results.json holds (`expert_load.tokens_per_expert`, summed
over its steps) and places them as a run given that file as `ep_placement` would
(te_mixtral/distributed/placement.py: heaviest first onto the emptiest rank with room; with
two experts a rank the best placement there is, which the tests check against every one).

What it measures is rows, from the run's summed load, as one placement held for the whole
run would meet it: not time (that is the run at EP with `ep_placement`), and not a
placement's drift when the router's load moves from step to step.

    python3 -m benchmarks.expert_placement RESULTS_JSON [RESULTS_JSON ...] [--json FILE]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks import common
from te_mixtral.distributed.placement import ExpertPlacement
from te_mixtral.measure.expert_load import busiest_over_mean, ep_sizes, rank_ratio


def placed_by_load(tokens_YE: torch.Tensor, ranks: int) -> torch.Tensor:
    """The rows each of `ranks` ranks gets per layer, [Y, ranks], the experts placed by load as
    `ep_placement` places them (te_mixtral/distributed/placement.py)."""
    return ExpertPlacement.by_load(tokens_YE, ranks).rows(tokens_YE.double())


def placed_busiest_over_mean(tokens_YE: torch.Tensor, ranks: int) -> float:
    """`busiest_over_mean`'s ratio with the experts placed by load (`placed_by_load`)."""
    return rank_ratio(placed_by_load(tokens_YE, ranks))


def compare(results_file: Path, load: dict) -> dict:
    """For each EP size the run's experts divide into: the busiest rank over the mean, placed
    as EP places them today and by load (`load`: the run's results.json's expert_load)."""
    tokens_YE = torch.tensor(load["tokens_per_expert"], dtype=torch.float64)
    per_step = load.get("busiest_rank_over_mean", {})
    return {"results": str(results_file), "steps": load.get("tokens_per_expert_steps"),
            "by_ep": {p: {"consecutive": busiest_over_mean(tokens_YE, p), "by_load": placed_busiest_over_mean(tokens_YE, p),
                          # what the steps met, each on its own load (the run's log): summing the
                          # steps first evens out what moves from step to step
                          "consecutive_per_step": (sum(per_step[str(p)]) / len(per_step[str(p)])
                                                   if per_step.get(str(p)) else None)}
                      for p in ep_sizes(tokens_YE.shape[1])}}


def read_load(results_file: Path) -> dict | None:
    """The expert_load of a run's results.json, or None (said in one line) where it holds none."""
    try:
        load = json.loads(results_file.read_text()).get("expert_load", {})
    except (OSError, ValueError, AttributeError) as e:
        print(f"expert_placement: {results_file} is not a run's results.json ({type(e).__name__})", file=sys.stderr)
        return None
    if "tokens_per_expert" not in load:
        print(f"expert_placement: {results_file} holds no expert_load.tokens_per_expert (a training run of an MoE "
              f"model writes it)", file=sys.stderr)
        return None
    return load


def _ratio(value: float | None) -> str:
    return "not logged" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", type=Path, help="results.json of training runs of an MoE model")
    common.add_json_flag(parser)
    args = parser.parse_args(argv)
    loads = [read_load(path) for path in args.results]
    if None in loads:
        return 2
    header = common.run_header(torch.device("cpu"))
    print(common.header_line(header))
    rows = [compare(path, load) for path, load in zip(args.results, loads)]
    print("busiest rank / mean rank, rows summed over layers, on the run's load summed over its steps: experts "
          "consecutive as today -> placed by load (consecutive as each step met it, the mean over the steps)")
    for row in rows:
        ratios = "  ".join(f"EP={p} {r['consecutive']:.3f} -> {r['by_load']:.3f} ({_ratio(r['consecutive_per_step'])})"
                           for p, r in row["by_ep"].items())
        print(f"{row['results']} (steps {row['steps']}): {ratios}")
    common.write_json(args.json, {"header": header, "runs": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
