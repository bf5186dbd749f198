"""Printing a run's results for a terminal, and saving them for the next run to compare.

Every run ends with one timing table, printed by rank 0, and one `results.json` in its
output folder:

    {"header":  {"date", "tier", "device", "world_size", "ep_size", "precision",
                 "versions", "config", ...},
     "summary": {...},            # metrics.summarize's dictionary
     "losses":  [...],            # the global (all-rank mean) LM loss of every step
     ...}                         # anything the caller adds as `extra`: the router's
                                  # "aux_losses", "z_losses" and "expert_load"
                                  # (te_mixtral/measure/expert_load.py), evaluations, phases

A later run reads the file back with `read_results` and hands its `losses` to
`loss_check.check_losses`, so the file must be complete or absent, never half written:
it is written to a temporary file in the same folder and renamed over the target, which
the filesystem does in one step (`te_mixtral.files.write_text_atomic`). A diverged run
still saves its losses: NaN is written as Python's `NaN`, which `json` reads back (strict
JSON tools such as `jq` do not). When the file cannot be written (a full disk), its whole
content is printed to stdout as one line, so the run's results survive in its log.
"""

import json
import platform
from collections.abc import Sequence
from datetime import datetime
from importlib import metadata
from pathlib import Path

from te_mixtral.config import RunConfig, to_dict
from te_mixtral.errors import UserError
from te_mixtral.files import require_regular_file, require_writable, write_failure, write_text_atomic
from te_mixtral.saved_config import RESULTS_FILE

CORE_KEYS = ("header", "summary", "losses")
# The distributions whose versions every results header records (besides Python's).
VERSIONED = ("torch", "transformers", "triton", "transformer_engine")
# The header keys the timing table prints, in order, its versions on a line under it; the
# rest of the header (the full config) goes to results.json only.
TABLE_HEADER_KEYS = (
    ("tier", "tier"),
    ("device", "device"),
    ("world_size", "world size"),
    ("ep_size", "EP size"),
    ("precision", "precision"),
)


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str] | None = None) -> str:
    """Plain ASCII columns: the first left-aligned (labels), the others right-aligned
    (numbers), a dashed rule under the header if one is given."""
    lines = [list(header)] if header else []
    lines += [list(row) for row in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]

    def render(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [cell.rjust(width) for cell, width in zip(cells[1:], widths[1:])]
        return "  ".join([first, *rest]).rstrip()

    out = [render(line) for line in lines]
    if header:
        out.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(out)


def package_version(distribution: str) -> str | None:
    """The installed version of a distribution (e.g. "torch"), or None if not installed."""
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict[str, str]:
    """The versions a result depends on; "not installed" for what is absent (Transformer
    Engine and Triton on many machines), so a header says so rather than leaving it out."""
    versions = {"python": platform.python_version()}
    for name in VERSIONED:
        versions[name] = package_version(name) or "not installed"
    return versions


def run_header(cfg: RunConfig, device_name: str, world_size: int) -> dict:
    """What a result needs to be read later: when, on what, with which versions and config."""
    return {
        "date": datetime.now().isoformat(timespec="seconds"),
        "tier": cfg.tier,
        "device": device_name,
        "world_size": world_size,
        "ep_size": cfg.ep_size,
        "precision": cfg.precision,
        "versions": software_versions(),
        "config": to_dict(cfg),
    }


def per_rank(device: str) -> str:
    """What a per-rank figure is per on `device` (a header's "device"): a GPU, or on a CPU a process."""
    return "process" if device == "cpu" else "GPU"


def tflops_text(tflops: float) -> str:
    """TFLOP/s as tables print it: one decimal, or under one (a CPU's) two significant
    digits, which a 0.0 would hide."""
    return f"{tflops:.1f}" if tflops >= 1 else f"{tflops:.2g}"


def timing_table(summary: dict, header: dict) -> str:
    """The end-of-run table: what ran where, then how fast (from `metrics.summarize`), and
    the software versions under it. The per-rank figures are per GPU, or on a CPU per process."""
    mfu = summary["mfu"]
    per = per_rank(header["device"])
    rows = [(label, str(header[key])) for key, label in TABLE_HEADER_KEYS]
    rows += [
        ("median step", f"{summary['median_step_ms']:.1f} ms"),
        ("p90 step", f"{summary['p90_step_ms']:.1f} ms"),
        ("tokens/s", f"{summary['tokens_per_s']:,.0f}"),
        (f"tokens/s/{per}", f"{summary['tokens_per_s_per_gpu']:,.0f}"),
        (f"TFLOP/s/{per}", tflops_text(summary["tflops_per_gpu"])),
        ("MFU", "n/a" if mfu is None else f"{100 * mfu:.1f} %"),
        ("peak memory", f"{summary['peak_memory_gib']:.2f} GiB"),
        ("timed steps", str(summary["timed_steps"])),
    ]
    versions = ", ".join(f"{name} {version}" for name, version in header["versions"].items())
    return format_table(rows, header=("metric", "value")) + f"\nversions: {versions}"


def write_results(
    output_dir: Path, header: dict, summary: dict, losses: list[float], extra: dict | None = None
) -> Path:
    """Write `output_dir/results.json` atomically and return its path; or print its content
    and raise `WriteFailed`."""
    extra = extra or {}
    clash = sorted(set(extra) & set(CORE_KEYS))
    if clash:
        raise ValueError(f"extra results may not replace {', '.join(clash)}")
    payload = {"header": header, "summary": summary, "losses": [float(x) for x in losses], **extra}

    path = output_dir / RESULTS_FILE
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(payload, indent=2))
    except OSError as e:
        print(f"{RESULTS_FILE} (not saved): {json.dumps(payload)}", flush=True)
        raise write_failure(f"{path} (its content is printed above)", e) from None
    return path


def read_results(path: Path | str) -> dict:
    """Load a results.json, or raise a one-line `UserError` saying why it is unusable."""
    path = Path(path)
    require_regular_file(path, "results file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UserError(f"results file {path} does not exist") from None
    except OSError as e:
        raise UserError(f"cannot read results file {path}: {e.strerror}") from None
    try:
        results = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"results file {path} is not valid JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(results, dict) or "losses" not in results:
        raise UserError(f"results file {path} has no 'losses': is it a te_mixtral results.json?")
    losses = results["losses"]
    if not isinstance(losses, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses):
        raise UserError(f"results file {path}: 'losses' must be a list of numbers")
    return results


def default_output_dir(tier: str, root: Path = Path("runs"), now: datetime | None = None) -> Path:
    """Create and return a fresh folder `root/<YYYYmmdd-HHMMSS>-<tier>`.

    Two runs started in the same second get `...-<tier>-2`, `-3`, and so on. The folder is
    created here, because creating it is the only race-free way to claim a name; call this
    on rank 0 only.
    """
    stem = f"{(now or datetime.now()).strftime('%Y%m%d-%H%M%S')}-{tier}"
    root.mkdir(parents=True, exist_ok=True)
    suffix = 1
    while True:
        path = root / (stem if suffix == 1 else f"{stem}-{suffix}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            suffix += 1


def prepare_output_dir(output_dir: str | None, tier: str) -> Path:
    """The run's output folder, created now so that an unwritable path fails before training."""
    if output_dir is None:
        return default_output_dir(tier)
    path = Path(output_dir)
    require_writable(path, "output directory")
    return path


def phases_table(phases_ms: dict, step_ms: float) -> str:
    """Each phase's time beside the measured step (see te_mixtral/measure/phases.py for the caveats)."""
    rows = [(name, f"{ms:.1f}", f"{100 * ms / step_ms:.0f} %") for name, ms in phases_ms.items()]
    rows.append(("sum of phases", f"{sum(phases_ms.values()):.1f}", f"{100 * sum(phases_ms.values()) / step_ms:.0f} %"))
    rows.append(("median step", f"{step_ms:.1f}", "100 %"))
    return format_table(rows, header=("phase (fwd+bwd)", "ms", "of step"))
