"""Results pages: runs' results.json files in, a dated markdown page with its plots out.

    python -m te_mixtral.results RUN [RUN ...] --out DIR [--title TEXT]
                                [--notes FILE] [--suffix TEXT] [--no-plots] [--overwrite]

A RUN is a run's output folder, its results.json, or a folder of runs such as
`scripts/gpu_runs.py tiers` leaves (`te_mixtral/results/runs.py` reads and checks them).

One page per GPU and world size. Step times only compare on the same hardware and the same
number of processes, so runs are grouped by (device name, world size) and each group gets
its own page, `OUT/<date>-<gpu>-x<world>[-<suffix>].md`, with `<stem>-step-time.png` and
`<stem>-loss.png` beside it (and `<stem>-expert-load-<run>.png` for each run that recorded
its expert load: te_mixtral/measure/expert_load.py). `<date>` is the day of the group's newest run; `<gpu>` is the
device name in lower case without the vendor ("NVIDIA H200" -> h200). `--out` has no
default (the committed pages live in docs/results; a page of one's own runs does not belong
there by accident), and a page or plot already in it is refused unless `--overwrite`: to
regenerate a committed page, pass both, and git shows what changed.

What a page compares (workloads, baselines, speedups, loss checks) is decided in
`te_mixtral/results/compare.py`.

Every page names how each run was made: a command line rebuilt from the run's saved config
(`te_mixtral/results/reproduce.py`) and the full config itself; and the command that made the page.
Runs made with `--profile_phases true` add a "Where the time goes" table. `--title` and
`--notes FILE` (a hand-written section, e.g. where a result goes against expectations) apply
to every page one command writes: give runs of different GPUs separate commands to word
them differently.
"""

import argparse
import importlib.util
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from te_mixtral.errors import UserError
from te_mixtral.files import write_text_atomic
from te_mixtral.measure.expert_load import busiest_ranks_text
from te_mixtral.measure.report import per_rank, tflops_text
from te_mixtral.results.compare import (
    COMPARED_WITH,
    DASH,
    assign_labels,
    assign_workloads,
    baseline_for,
    differences,
    letter,
    loss_verdict,
    speedup,
)
from te_mixtral.results.reproduce import reproduce_command
from te_mixtral.results.runs import Run, find_runs, group_runs

# --- the page ------------------------------------------------------------------------------


def page_command(argv: list[str]) -> str:
    # The pages name this module itself, as the committed pages in docs/results do (both
    # forms run the same `main`), so that they regenerate unchanged; and leave out
    # --overwrite, which is about the folder, not the page.
    return " ".join(["python", "-m", "te_mixtral.results.pages", *map(shlex.quote, (a for a in argv
                                                                                    if a != "--overwrite"))])


def slug(text: str) -> str:
    text = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return re.sub(r"^nvidia-", "", text) or "device"


def page_stem(runs: list[Run], suffix: str | None) -> str:
    newest = max(r.date for r in runs)
    stem = f"{newest:%Y-%m-%d}-{slug(runs[0].header['device'])}-x{runs[0].world_size}"
    return f"{stem}-{slug(suffix)}" if suffix else stem


def describe_workload(workload_: dict) -> str:
    """One line a person reads; the full config is further down the page."""
    w = {k: workload_.get(k, "?") for k in (
        "model.num_hidden_layers", "model.hidden_size", "model.intermediate_size", "model.num_experts",
        "model.num_experts_per_tok", "model.vocab_size", "train.batch_size", "data.seq_len", "train.steps",
        "train.timing_warmup_steps", "precision", "data.dataset")}
    return (f"{w['model.num_hidden_layers']} layers, hidden {w['model.hidden_size']}, expert FFN "
            f"{w['model.intermediate_size']}, {w['model.num_experts']} experts top-"
            f"{w['model.num_experts_per_tok']}, vocab {w['model.vocab_size']}; batch {w['train.batch_size']} x "
            f"seq {w['data.seq_len']} tokens per step, {w['train.steps']} steps of which the first "
            f"{w['train.timing_warmup_steps']} are left out of the timing; {w['precision']}; data "
            f"`{w['data.dataset']}`")


def _versions(run: Run) -> str:
    return ", ".join(f"{k} {v}" for k, v in run.header.get("versions", {}).items() if v) or "not recorded"


def _table(header: list[str], rows: list[list[str]], text_columns: tuple[int, ...] = (0,)) -> str:
    """A markdown table; numbers right-aligned, the `text_columns` left-aligned."""
    text_columns = {i % len(header) for i in text_columns}
    aligns = ["---" if i in text_columns else "---:" for i in range(len(header))]
    lines = [header, aligns, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


@dataclass
class Page:
    stem: str  # the file name without .md; the PNGs are <stem>-step-time.png and <stem>-loss.png
    markdown: str
    runs: list[Run]


def tier_rows(runs: list[Run]) -> tuple[list[list[str]], list[str]]:
    """The tier table's rows, and the notes its cells point to."""
    rows, notes = [], []
    for run in runs:
        s = run.summary
        cells = [f"`{run.label}`" + (f" ({run.header['ran']['recipe']})" if "recipe" in run.header.get("ran", {})
                                     else ""),
                 f"{run.world_size} / {run.ep_size}", f"{s['median_step_ms']:.1f}", f"{s['p90_step_ms']:.1f}"]
        for tier in COMPARED_WITH:
            base = baseline_for(run, tier, runs)
            ratio = speedup(run, base)
            cell = DASH if ratio is None else f"{ratio:.2f}x"
            if base is not None and base.ep_size != run.ep_size:
                cell += f" (vs EP{base.ep_size})"
            cells.append(cell)
        mfu = s["mfu"]
        cells += [f"{s['tokens_per_s_per_gpu']:,.0f}", tflops_text(s["tflops_per_gpu"]),
                  "n/a" if mfu is None else f"{100 * mfu:.1f} %", f"{s['peak_memory_gib']:.2f}"]
        verdict = loss_verdict(run, runs)
        cells.append(verdict.cell)
        if verdict.note:
            notes.append(verdict.note)
        rows.append(cells)
    return rows, notes


def warnings_for(runs: list[Run], workloads: list[dict]) -> list[str]:
    warnings = []
    for tier in COMPARED_WITH:
        if not any(r.tier == tier for r in runs):
            warnings.append(f"No `{tier}` run in this set: the `vs {tier}` column is empty.")
    for index, w in enumerate(workloads[1:], start=1):
        warnings.append(f"Mismatched configs: workload {letter(index)} differs from A in "
                        + "; ".join(f"`{d}`" for d in differences(workloads[0], w))
                        + ". Speedups compare runs of the same workload only.")
    if len({_versions(r) for r in runs}) > 1:
        warnings.append("The runs used different software versions (listed per run below).")
    for run in runs:
        if loss_verdict(run, runs).failed:
            warnings.append(f"`{run.label}` fails its loss check: its speed is not a result until that is "
                            f"explained.")
    return warnings


def phases_section(runs: list[Run]) -> list[str]:
    """Runs made with `--profile_phases true`: each phase's time (te_mixtral/measure/phases.py), one column per run."""
    profiled = [r for r in runs if isinstance(r.results.get("phases_ms"), dict)]
    if not profiled:
        return []
    names = list(dict.fromkeys(name for r in profiled for name in r.results["phases_ms"]))

    def cell(run: Run, ms: float | None) -> str:
        return DASH if ms is None else f"{ms:.1f} ({100 * ms / run.summary['median_step_ms']:.0f} %)"

    rows = [[name] + [cell(r, r.results["phases_ms"].get(name)) for r in profiled] for name in names]
    rows.append(["sum of phases"] + [cell(r, sum(r.results["phases_ms"].values())) for r in profiled])
    rows.append(["median step"] + [f"{r.summary['median_step_ms']:.1f}" for r in profiled])
    explain = ("Each phase of a step timed on its own after training, summed over layers (`te_mixtral/measure/phases.py`). "
               "A phase run alone loses its overlap with its neighbours, so the phases need not add up to the step.")
    if any(len(r.results.get("expert_rows_per_rank", [])) > 1 for r in profiled):
        rows.append(["expert rows: busiest rank / mean"]
                    + [_imbalance(r.results.get("expert_rows_per_rank")) for r in profiled])
        rows.append(["experts: ms per 1,000 rows of the busiest rank"]
                    + [_per_busiest_rows(r.results["phases_ms"].get("experts"), r.results.get("expert_rows_per_rank"))
                       for r in profiled])
        explain += (" With several ranks each phase is its slowest rank's, and the last two rows say how unevenly "
                    "the router spread that step's rows (summed over layers) over the ranks' experts, and what the "
                    "experts cost per row of the rank that got the most: tiers compare on that row, since "
                    "routing, and so the balance, drifts apart between runs as their bf16 rounding differs.")
    header = ["phase, fwd+bwd: ms (share of the median step)"] + [f"`{r.label}`" for r in profiled]
    return ["## Where the time goes", "", explain, "", _table(header, rows), ""]


def _per_busiest_rows(experts_ms: float | None, rows_per_rank: list[int] | None) -> str:
    if experts_ms is None or not rows_per_rank:
        return DASH
    return f"{1000 * experts_ms / max(rows_per_rank):.2f}"


def _imbalance(rows_per_rank: list[int] | None) -> str:
    if not rows_per_rank or len(rows_per_rank) < 2:
        return DASH
    busiest = max(rows_per_rank)
    return f"{busiest * len(rows_per_rank) / sum(rows_per_rank):.2f}x ({busiest:,} rows)"


def expert_load_png_name(stem: str, run: Run) -> str:
    return f"{stem}-expert-load-{slug(run.label)}.png"


def router_lines(run: Run, stem: str, plots: bool) -> list[str]:
    """A run that recorded its router losses and expert load (te_mixtral/measure/expert_load.py):
    their means over the run, and its heatmap."""
    load = run.results.get("expert_load")
    if not isinstance(load, dict) or not run.results.get("aux_losses"):
        return []

    def mean(values: list[float]) -> str:
        return f"{sum(values) / len(values):.3f}"

    busiest = busiest_ranks_text({p: mean(v) for p, v in load.get("busiest_rank_over_mean", {}).items()},
                                 run.ep_size)
    out = [f"- router: aux loss {mean(run.results['aux_losses'])}, z-loss {mean(run.results['z_losses'])}, "
           f"expert max/mean {mean(load['max_over_mean'])}" + (f", {busiest}" if busiest else "")
           + " (means over the run's steps)", ""]
    if plots and "tokens_per_expert" in load:
        first, last = load["tokens_per_expert_steps"]
        out += [f"![Expert load per layer, steps {first} to {last}]({expert_load_png_name(stem, run)})", ""]
    return out


def run_section(run: Run, stem: str = "", plots: bool = False) -> list[str]:
    """How one run was made: when, on what, the command, the full config; and its router's
    balance when it recorded it."""
    ran = ", ".join(f"{k} {v}" for k, v in run.header.get("ran", {}).items())
    out = [f"### `{run.label}` (`{run.source}`)", "",
           f"- date {run.date.isoformat()}, {run.header['precision']}, EP {run.ep_size}, workload {run.workload}; "
           f"ran: {ran or 'not recorded'}",
           f"- versions: {_versions(run)}", ""]
    out += router_lines(run, stem, plots)
    command = reproduce_command(run.header["config"], run.world_size)
    if command:
        out += ["```bash", command, "```", ""]
    return out + ["<details><summary>config</summary>", "", "```yaml",
                  yaml.safe_dump(run.header["config"], sort_keys=False).rstrip(), "```", "", "</details>", ""]


def build_page(runs: list[Run], title: str | None, notes: str | None, command: str, suffix: str | None = None,
               plots: bool = True) -> Page:
    """The markdown of one page (one device and world size); `runs` are one `group_runs` group."""
    workloads = assign_workloads(runs)
    assign_labels(runs)
    stem = page_stem(runs, suffix)
    device, world = runs[0].header["device"], runs[0].world_size
    dates = sorted(r.date for r in runs)
    versions = {_versions(r) for r in runs}
    out = [f"# {title or f'te_mixtral expert tiers on {device} x {world}'}", ""]
    where = (f"- **GPU**: {device} x {world} (world size {world}, one process per GPU)" if device != "cpu" else
             f"- **Device**: cpu, {world} process{'es' if world > 1 else ''}")
    out += [where,
            f"- **Date**: {dates[-1]:%Y-%m-%d} (runs from {dates[0].isoformat()} to {dates[-1].isoformat()})",
            f"- **Versions**: {versions.pop() if len(versions) == 1 else 'differ between runs, see below'}"]
    if len(workloads) == 1:
        out.append(f"- **Workload**: {describe_workload(workloads[0])}")
    else:
        out += [f"- **Workload {letter(i)}**: {describe_workload(w)}" for i, w in enumerate(workloads)]
    out += [f"- **This page**: `{command}`", ""]

    warnings = warnings_for(runs, workloads)
    if warnings:
        out += ["> **Check before reading**", ">"] + [f"> - {w}" for w in warnings] + [""]

    per = per_rank(device)
    header = ["tier", "world / EP", "median step (ms)", "p90 step (ms)", *(f"vs {t}" for t in COMPARED_WITH),
              f"tokens/s/{per}", f"TFLOP/s/{per}", "MFU", "peak memory (GiB)",
              "loss check vs `loop` (rel diff: first step, max step, mean)"]
    rows, footnotes = tier_rows(runs)
    out += ["## Tiers", "", _table(header, rows, text_columns=(0, -1)), ""]
    out += [f"- {note}" for note in footnotes] + ([""] if footnotes else [])
    # On a CPU the memory measured is each process's peak resident set (measure/metrics.py).
    memory = ("Peak memory is the largest peak resident set of any process: Python, the libraries and the data "
              "included, not the tensors alone" if device == "cpu" else
              "Peak memory is the most the caching allocator handed to tensors on any rank")
    out += ["How to read it: `vs hf` and `vs loop` are the baseline's median step time divided by this row's "
            "(same device, same world size, same workload; above 1 is faster). Step times leave out the "
            f"warm-up steps; tokens/s and TFLOP/s are per {per}, TFLOP/s counts model FLOPs only (no "
            "recomputation, no all-to-all), and MFU divides them by the GPU's dense BF16 peak "
            f"(`te_mixtral/measure/metrics.py`). {memory}. The loss check compares every step's loss with the "
            "`loop` run's (`te_mixtral/measure/loss_check.py`).", ""]
    if plots:
        out += [f"![Median step time per tier]({stem}-step-time.png)", "",
                f"![Training loss per step, all tiers]({stem}-loss.png)", ""]
    out += phases_section(runs)
    if notes:
        first = notes.lstrip().splitlines()[0] if notes.strip() else ""
        out += ([] if first.startswith("## ") else ["## Notes", ""]) + [notes.strip(), ""]

    out += ["## Runs", "", "Each command rebuilds the run's config from a file in `configs/` plus overrides; the "
            "full config it ran with follows it.", ""]
    for run in runs:
        out += run_section(run, stem, plots)
    return Page(stem, "\n".join(out), runs)


def page_files(page: Page, out_dir: Path) -> list[Path]:
    """Every file `write_page` may write for `page`: the markdown, then the plots."""
    names = [f"{page.stem}.md", f"{page.stem}-step-time.png", f"{page.stem}-loss.png"]
    return [out_dir / name for name in names + [expert_load_png_name(page.stem, run) for run in page.runs]]


def write_page(page: Page, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write the page's markdown and, with `plots`, its PNGs; return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, step_time, loss, *_ = page_files(page, out_dir)
    write_text_atomic(md, page.markdown)
    written = [md]
    if plots:
        from te_mixtral.measure import plots as draw

        runs = page.runs
        # A figure travels without its page: it names the GPU, date, versions and where the
        # runs' commands are.
        where = f"{runs[0].header['device']} x {runs[0].world_size}"
        made = (f"{max(r.date for r in runs):%Y-%m-%d}, {_versions(runs[-1])}\n"
                f"runs and their commands: {page.stem}.md (python -m te_mixtral.results.pages)")
        written.append(draw.save(draw.step_time_figure(
            [r.label for r in runs], [r.summary["median_step_ms"] for r in runs],
            [r.summary["p90_step_ms"] for r in runs], f"Step time per tier, {where}\n{made}"), step_time))
        written.append(draw.save(draw.loss_figure(
            [(r.label, r.results["losses"]) for r in runs], f"Training loss per step, {where}\n{made}"), loss))
        for run in runs:
            load = run.results.get("expert_load")
            if isinstance(load, dict) and "tokens_per_expert" in load:
                first, last = load["tokens_per_expert_steps"]
                written.append(draw.save(draw.expert_load_figure(
                    load["tokens_per_expert"], f"Expert load of {run.label}, steps {first}-{last}, {where}\n{made}"),
                    out_dir / expert_load_png_name(page.stem, run)))
    return written


# --- command line --------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m te_mixtral.results",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="run folder, results.json, or folder of runs")
    parser.add_argument("--out", required=True, help="folder for the pages (docs/results holds the committed ones)")
    parser.add_argument("--title", help="page title (default: 'te_mixtral expert tiers on <GPU> x <world>')")
    parser.add_argument("--notes", help="markdown file included as the page's explanation section")
    parser.add_argument("--suffix", help="appended to the page name: <date>-<gpu>-x<world>-<suffix>.md")
    parser.add_argument("--no-plots", action="store_true", help="write the markdown only (no matplotlib needed)")
    parser.add_argument("--overwrite", action="store_true", help="replace a page or plot already in --out")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        notes = None
        if args.notes:
            try:
                notes = Path(args.notes).read_text()
            except OSError as e:
                raise UserError(f"cannot read notes file {args.notes}: {e.strerror}") from None
        plots = not args.no_plots
        if plots and importlib.util.find_spec("matplotlib") is None:
            raise UserError("the plots need matplotlib: pip install matplotlib (or pass --no-plots)")
        groups = group_runs(find_runs(args.runs))
        pages = [build_page(runs, args.title, notes, page_command(argv), args.suffix, plots)
                 for runs in groups.values()]
        stems = [p.stem for p in pages]
        if len(set(stems)) < len(stems):  # e.g. "NVIDIA H200" and "nvidia h200" slug alike
            raise UserError(f"two groups would write the same page ({', '.join(stems)}); pass runs separately")
        there = [path for page in pages for path in page_files(page, Path(args.out))
                 if path.exists() and (plots or path.suffix == ".md")]
        if there and not args.overwrite:
            more = f" (and {len(there) - 1} more files of these pages)" if len(there) > 1 else ""
            raise UserError(f"{there[0]} exists{more}: pass --overwrite to replace, or another --out")
        for page in pages:
            for path in write_page(page, Path(args.out), plots):
                print(f"wrote {path}")
    except UserError as e:
        print(f"te_mixtral: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
