"""Two kernel profiles side by side: where one step spends GPU time that the other does not.

Reads the `--json` files of two benchmarks/kernel_profile.py runs (ours and TE's example, or
ours with and without an option) and prints one markdown table, a row per kind of kernel:
each side's milliseconds and launches per step and the difference, then the kernels' sum,
the idle time inside the step and the span (first kernel's start to last kernel's end):

    python3 -m benchmarks.kernel_compare OURS.json TE.json

Both profiles on one GPU, then this table: `python3 scripts/gpu_runs.py depth OUT kernels-vs-te`.
"""

import argparse
import json
import sys
from pathlib import Path


def side_by_side(a: dict, b: dict, names: tuple[str, str]) -> str:
    """The markdown table of profiles `a` and `b` (kernel_profile.py's JSON), kinds by the
    larger side's time, longest first."""
    kinds = sorted(set(a["kinds"]) | set(b["kinds"]),
                   key=lambda k: -max(side["kinds"].get(k, {}).get("ms", 0.0) for side in (a, b)))
    first, second = names
    lines = [f"| kernels per step | {first} ms | {second} ms | {first} - {second} ms | {first} launches "
             f"| {second} launches |", "| --- | ---: | ---: | ---: | ---: | ---: |"]

    def row(label, ms_a, ms_b, launches_a="", launches_b=""):
        lines.append(f"| {label} | {ms_a:.1f} | {ms_b:.1f} | {ms_a - ms_b:+.1f} | {launches_a} | {launches_b} |")

    for kind in kinds:
        ka, kb = (side["kinds"].get(kind, {"ms": 0.0, "launches": 0.0}) for side in (a, b))
        row(kind, ka["ms"], kb["ms"], f"{ka['launches']:.0f}", f"{kb['launches']:.0f}")
    row("**all kernels**", a["kernel_ms"], b["kernel_ms"], f"{a['launches']:.0f}", f"{b['launches']:.0f}")
    row("GPU idle inside the step", a["idle_ms"], b["idle_ms"])
    row("span (kernels and idle)", a["span_ms"], b["span_ms"])
    return "\n".join(lines)


def describe(profile: dict, path: Path) -> str:
    header = profile["header"]
    return f"{profile['label']}: {header['device']}, {header['date']} ({path})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("first", type=Path, help="a kernel_profile.py --json file (ours)")
    parser.add_argument("second", type=Path, help="another (TE's example)")
    parser.add_argument("--names", nargs=2, default=None, help="the two columns' names (default: ours, te)")
    args = parser.parse_args(argv)
    profiles = []
    for path in (args.first, args.second):
        try:
            profiles.append(json.loads(path.read_text()))
        except (OSError, ValueError) as error:
            print(f"kernel_compare: error: cannot read {path}: {error}", file=sys.stderr)
            return 2
    names = tuple(args.names or (p["header"]["which"] for p in profiles))
    for profile, path in zip(profiles, (args.first, args.second), strict=True):
        print(describe(profile, path))
    print(side_by_side(*profiles, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
