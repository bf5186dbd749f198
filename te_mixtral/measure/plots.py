"""The pictures of a run and of a results page: step time per tier, the loss curves
overlaid, a run's step time step by step, and for a run that recorded it, its expert load
as a layer x expert heatmap. A training run draws its own loss and step-time plots beside
its results.json (te_mixtral/measure/run_log.py); the offline results pages draw the rest.

matplotlib is imported inside each function, so importing this module costs nothing and a
machine without matplotlib can still train (`pip install matplotlib` to draw). Figures are built
on `matplotlib.figure.Figure` directly rather than through `pyplot`: pyplot keeps global
state (a current figure, a backend picked at first use, which on a machine with a display
may be an interactive one); a bare `Figure` always renders with Agg to a file and leaves
nothing behind.

The PNGs are written without the "Software" metadata entry, so re-drawing the same numbers
with the same matplotlib gives the same bytes and a regenerated page shows no spurious
diff.
"""

import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path

PNG_METADATA = {"Software": None}


def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120, layout="constrained")
    return fig, fig.subplots()


def step_time_png(labels: Sequence[str], median_ms: Sequence[float], p90_ms: Sequence[float], path: Path,
                  title: str) -> Path:
    """One bar per run: its median step time, a whisker up to its p90, the median under the bar's name."""
    fig, ax = _figure(max(5.0, 1.3 * len(labels) + 2.0))
    positions = list(range(len(labels)))
    upper = [max(0.0, p90 - median) for median, p90 in zip(median_ms, p90_ms)]
    ax.bar(positions, median_ms, yerr=[[0.0] * len(upper), upper], capsize=4, color="#4c72b0",
           error_kw={"ecolor": "#555555", "elinewidth": 1})
    # The value goes in the tick label, not on the bar: there it collides with the whisker,
    # and a fast tier's short bar has no room for it.
    ticks = [f"{textwrap.fill(label, 16)}\n{median:.1f} ms" for label, median in zip(labels, median_ms)]
    ax.set_xticks(positions, ticks, fontsize=8)
    ax.set_ylabel("step time (ms): median, whisker to p90")
    ax.set_ylim(0, max(p90_ms) * 1.15 if p90_ms else 1)
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, metadata=PNG_METADATA)
    return path


def loss_png(curves: Sequence[tuple[str, Sequence[float]]], path: Path, title: str,
             evals: Sequence[tuple[int, float]] = ()) -> Path:
    """Every run's per-step loss on one set of axes; steps count from 1 as the training log
    does. `evals`, (step, loss) of one run's held-out evaluations, are drawn over them."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    markers = "os^vDP*X"
    for index, (label, losses) in enumerate(curves):
        steps = range(1, len(losses) + 1)
        ax.plot(steps, losses, label=label, marker=markers[index % len(markers)], markersize=3, linewidth=1.2,
                alpha=0.85)
    if evals:
        ax.plot(*zip(*evals), label="held-out (eval)", color="#c44e52", marker="s", markersize=5, linewidth=1.2,
                linestyle="--")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training and held-out loss (global mean)" if evals else "training loss (global mean)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    fig.savefig(path, metadata=PNG_METADATA)
    return path


def step_times_png(first_step: int, step_ms: Sequence[float], timing_warmup: int, path: Path, title: str) -> Path:
    """One run's step time at every step it ran (counted from `first_step`), its first
    `timing_warmup` steps marked as the warm-up the statistics leave out, and the median of
    the others as a line."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    steps = list(range(first_step, first_step + len(step_ms)))
    ax.plot(steps, step_ms, color="#4c72b0", marker="o", markersize=3, linewidth=1.2, label="step")
    if timing_warmup:
        ax.plot(steps[:timing_warmup], step_ms[:timing_warmup], color="#c44e52", marker="o", markersize=3,
                linewidth=0, label="warm-up (not in the statistics)")
    if step_ms[timing_warmup:]:
        median = statistics.median(step_ms[timing_warmup:])
        ax.axhline(median, color="#555555", linewidth=1, linestyle="--", label=f"median {median:.1f} ms")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(step_ms) * 1.1 if step_ms else 1)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, metadata=PNG_METADATA)
    return path


def expert_load_png(tokens_per_expert_YE: Sequence[Sequence[int]], path: Path, title: str) -> Path:
    """One cell per layer and expert: its share of the layer's rows over the even share, so
    1 is balanced and every layer reads on one scale."""
    layers, experts = len(tokens_per_expert_YE), len(tokens_per_expert_YE[0])
    fig, ax = _figure(max(6.5, 0.5 * experts + 2.5), max(3.5, 0.25 * layers + 2.0))
    shares = [[count * len(row) / max(sum(row), 1) for count in row] for row in tokens_per_expert_YE]
    image = ax.imshow(shares, cmap="viridis", aspect="auto", interpolation="nearest")
    fig.colorbar(image, ax=ax, label="rows / even share")
    ax.set_xticks(range(experts))
    ax.set_yticks(range(layers))
    ax.tick_params(labelsize=7)
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)
    fig.savefig(path, metadata=PNG_METADATA)
    return path
