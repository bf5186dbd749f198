"""What every benchmark shares: the Mixtral shapes, one timer, the run header and `--json`.

Shape suffixes: see te_mixtral/__init__.py (D model dim, F expert hidden dim, L local
experts, R rows).

- Shapes: `FAMILIES` holds the expert shapes of Mixtral-8x7B and 8x22B; `LOCAL_EXPERTS` is
  the 4 local experts most benchmarks time (a rank at EP=2 of an 8-expert layer).
- Timer: `median_ms` runs a step `WARMUP_STEPS` times untimed, then times many steps, each
  between CUDA events on a GPU (so the host's launch queueing is not counted) or between
  synchronised `perf_counter` reads on a CPU, and returns the median. A script that times
  something else (a whole training step through the app's metrics, a first call's
  compilation, GPU time with the host queued ahead) says why where it does.
- `run_header` is the date, the device and the versions a figure needs to be read later;
  `header_line` prints it once, at the start of a run.
- `add_json_flag` is every benchmark's one output flag, `--json FILE`, refused as the command
  line is read where it cannot be written (`json_path`); `write_json` writes the payload there
  (the header in it) and says where.

torch is imported inside the functions that use it: the peer benchmarks (te_example.py,
peft_peer.py) refuse bad arguments in one line before anything heavy loads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from te_mixtral.files import unwritable, write_text_atomic
from te_mixtral.measure.report import software_versions

if TYPE_CHECKING:
    import torch

# --- shapes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    hidden: int  # D
    ffn: int  # F


FAMILIES = {"8x7b": Family(4096, 14336), "8x22b": Family(6144, 16384)}
LOCAL_EXPERTS = 4  # L


def split_by_fractions(total: int, fractions: tuple[float, ...]) -> list[int]:
    """Integer split of `total` rows by `fractions`; rounding goes to the largest share."""
    splits = [round(total * f) for f in fractions]
    splits[splits.index(max(splits))] += total - sum(splits)
    return splits


# --- the timer ---------------------------------------------------------------------------

WARMUP_STEPS = 3


def synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(step, device: torch.device, budget_ms: float = 400, min_reps: int = 5, max_reps: int = 100) -> float:
    """Median time of `step()` in ms after WARMUP_STEPS untimed calls; as many timed calls
    as fit in `budget_ms` (one untimed call estimates that), within [min_reps, max_reps]."""
    import torch

    for _ in range(WARMUP_STEPS):
        step()
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    estimate_ms = (time.perf_counter() - start) * 1e3
    reps = max(min_reps, min(max_reps, math.ceil(budget_ms / max(estimate_ms, 1e-3))))
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for begin, end in events:
            begin.record()
            step()
            end.record()
        synchronize(device)
        return statistics.median(begin.elapsed_time(end) for begin, end in events)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def matmul_peak_tflops(n: int, device: torch.device) -> float:
    """The bf16 matmul rate measured here (n x n x n, random values): the compute ceiling."""
    import torch

    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    return 2 * n**3 / (median_ms(lambda: a @ b, device) * 1e-3) / 1e12


def copy_bandwidth_gbs(nbytes: int, device: torch.device) -> float:
    """Device-to-device copy measured here; bytes read plus bytes written, per second."""
    import torch

    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / (median_ms(lambda: dst.copy_(src), device) * 1e-3) / 1e9


# --- the run header ----------------------------------------------------------------------


def run_header(device: torch.device, **details) -> dict:
    """When, on what and with which versions a benchmark ran, and its own `details`."""
    import torch

    from te_mixtral.measure.metrics import device_name

    return {"date": datetime.now().astimezone().isoformat(timespec="seconds"), "device": device_name(device),
            "versions": {**software_versions(), "cuda": torch.version.cuda}, **details}


def header_line(header: dict) -> str:
    v = header["versions"]
    return (f"date {header['date']}  device {header['device']}  torch {v['torch']} (CUDA {v['cuda']})  "
            f"TE {v['transformer_engine']}  triton {v['triton']}  transformers {v['transformers']}  "
            f"python {v['python']}")


def device_argument(text: str) -> torch.device:
    """A `--device` flag's value as torch names devices (cpu, cuda, cuda:1), or argparse's
    one-line refusal."""
    import torch

    try:
        return torch.device(text)
    except RuntimeError:  # torch's message lists every device type it knows of
        raise argparse.ArgumentTypeError(f"no device '{text}': name one as torch does (cpu, cuda, cuda:1)") from None


def add_device_flag(parser: argparse.ArgumentParser) -> None:
    """`--device`: where a script with a CPU smoke test runs (default: the GPU, if any)."""
    import torch

    default = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--device", type=device_argument, default=default)


def cuda_or_refuse(script: str) -> torch.device | None:
    """The current GPU, or None after one line on stderr saying `script` needs one."""
    import torch

    if not torch.cuda.is_available():
        print(f"{script}: error: needs a CUDA GPU, and none is visible", file=sys.stderr)
        return None
    return torch.device("cuda", torch.cuda.current_device())


def first_line(error: Exception) -> str:
    """An error as one line: why a column or a library was skipped."""
    return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


# --- the output flag ---------------------------------------------------------------------


def add_json_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=json_path, default=None, help="also write the numbers and the run header here")


def json_path(text: str) -> Path:
    """A file a script writes with `write_json` once it has run (`--json`), checked as the
    command line is read, so that a path it cannot write costs no run: an argparse `type`.
    Folders missing on the way are fine (`write_json` makes them) under one that can be
    written."""
    path = Path(text)
    try:
        if path.is_dir():
            raise argparse.ArgumentTypeError(f"cannot write {text}: it is a folder: name the file to write")
        blocked = unwritable(path.absolute().parent)
        if blocked is not None:
            raise argparse.ArgumentTypeError(f"cannot write {text}: {blocked[0]} {blocked[1]}")
        if path.exists() and not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"cannot write {text}: it is not writable")
    except OSError as error:  # a name too long, a folder on the way that cannot be read
        raise argparse.ArgumentTypeError(f"cannot write {text}: {error.strerror}") from None
    return path


def write_json(path: Path | None, payload: dict) -> None:
    """`payload` to `path` (nothing where --json was not given), its folder made if missing."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")  # a run killed midway leaves no half file
    print(f"wrote {path}")
