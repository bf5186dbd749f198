"""Finished runs as the results pages read them: each run's results.json, checked on load.

A run is named by its output folder (what `run_finetune_ep.py --output-dir` wrote:
results.json and config.yaml), by its results.json file, or by a folder whose sub-folders
are runs (what `scripts/gpu_runs.py tiers OUT_DIR ...` leaves: OUT_DIR/loop, OUT_DIR/hf, ...).
"""

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from te_mixtral.errors import UserError
from te_mixtral.experts.registry import RUN_NAMES
from te_mixtral.measure.report import RESULTS_FILE, read_results

SUMMARY_KEYS = ("median_step_ms", "p90_step_ms", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_memory_gib")
HEADER_KEYS = ("date", "tier", "device", "world_size", "ep_size", "precision", "config")


@dataclass
class Run:
    source: str  # the path as the user gave it (shown on the page)
    results: dict
    label: str = ""  # the row's name on the page, unique within it
    workload: str = "A"

    @property
    def header(self) -> dict:
        return self.results["header"]

    @property
    def summary(self) -> dict:
        return self.results["summary"]

    @property
    def tier(self) -> str:
        return self.header["tier"]

    @property
    def ep_size(self) -> int:
        return self.header["ep_size"]

    @property
    def world_size(self) -> int:
        return self.header["world_size"]

    @property
    def date(self) -> datetime:
        return datetime.fromisoformat(self.header["date"])


def _load_run(path: Path, source: str) -> Run:
    results = read_results(path)
    header, summary = results.get("header"), results.get("summary")
    if not isinstance(header, dict) or not isinstance(summary, dict):
        raise UserError(f"{path} has no 'header' and 'summary': was it written by run_finetune_ep.py?")
    missing = [k for k in HEADER_KEYS if k not in header] + [k for k in SUMMARY_KEYS if k not in summary]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}: written by an older te_mixtral?")
    try:
        datetime.fromisoformat(header["date"])
    except (TypeError, ValueError):
        raise UserError(f"{path}: header date {header['date']!r} is not an ISO date") from None
    return Run(source, results)


def find_runs(paths: list[str]) -> list[Run]:
    """Every run named by `paths` (run folders, results.json files, or folders of runs)."""
    runs = []
    for text in paths:
        path = Path(text)
        if path.is_file():
            runs.append(_load_run(path, text))
        elif (path / RESULTS_FILE).is_file():
            runs.append(_load_run(path / RESULTS_FILE, text))
        elif path.is_dir():
            children = sorted(p for p in path.iterdir() if (p / RESULTS_FILE).is_file())
            if not children:
                raise UserError(f"{path} holds no {RESULTS_FILE}, and no sub-folder does")
            runs += [_load_run(child / RESULTS_FILE, str(child)) for child in children]
        else:
            raise UserError(f"{path} does not exist")
    return runs


def group_runs(runs: list[Run]) -> dict[tuple[str, int], list[Run]]:
    """Runs by (device, world size), each group sorted in tier order, then EP size, then date."""
    order = {name: i for i, name in enumerate(RUN_NAMES)}
    groups: dict[tuple[str, int], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.header["device"], run.world_size), []).append(run)
    for members in groups.values():
        members.sort(key=lambda r: (order.get(r.tier, len(order)), r.tier, r.ep_size, r.date))
    return groups
