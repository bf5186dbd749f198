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

Each `*_figure` function returns the figure (tests read its lines back); `save` writes it.
The PNGs are written without the "Software" metadata entry, so re-drawing the same numbers
with the same matplotlib gives the same bytes and a regenerated page shows no spurious
diff.
"""

import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path

from te_mixtral.files import atomic_file

PNG_METADATA = {"Software": None}
# A loss curve this long gets a smoothed line (an EMA) over its raw one, drawn faint: step to
# step noise hides the trend of a long run. Shorter ones are drawn raw, every step marked.
SMOOTH_FROM_STEPS = 50
# Each series gets its own line style and marker, and the first drawn is the widest: a later
# series identical to an earlier one covers it only partly, so both stay visible.
LINE_STYLES = ("-", "--", "-.", ":")
MARKERS = "os^vDP*X"


def _figure(width: float = 7.0, height: float = 4.0):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=120, layout="constrained")
    return fig, fig.subplots()


def _title(ax, title: str) -> None:
    """A title of several lines (what, then how it was made), each wrapped to the figure's
    width: constrained layout makes room above the axes for the lines, not beside the figure."""
    ax.set_title(title, fontsize=9, wrap=True)


def save(fig, path: Path) -> Path:
    """Write a figure as a PNG with no "Software" entry (see the module docstring), whole or
    not at all (`files.atomic_file`: a run killed while it draws leaves no half picture)."""
    with atomic_file(path, "wb") as f:
        fig.savefig(f, format="png", metadata=PNG_METADATA)
    return path


def ema(values: Sequence[float], span: int) -> list[float]:
    """The exponential moving average of `values` with weight 2 / (span + 1) per new value,
    divided by the weights summed so far, so that the first values are not pulled to zero
    (pandas' `ewm(span=span).mean()`; TensorBoard's smoothing debiases the same way)."""
    alpha, total, weight, out = 2 / (span + 1), 0.0, 0.0, []
    for value in values:
        total = (1 - alpha) * total + value
        weight = (1 - alpha) * weight + 1
        out.append(total / weight)
    return out


def step_time_figure(labels: Sequence[str], median_ms: Sequence[float], p90_ms: Sequence[float], title: str):
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
    _title(ax, title)
    ax.grid(axis="y", alpha=0.3)
    return fig


def loss_figure(curves: Sequence[tuple[str, Sequence[float]]], title: str, evals: Sequence[tuple[int, float]] = ()):
    """Every run's per-step loss on one set of axes; steps count from 1 as the training log
    does. A curve of SMOOTH_FROM_STEPS steps or more is drawn faint, with its EMA over about
    a twentieth of the run as a line of its own. `evals`, (step, loss) of one run's held-out
    evaluations, are drawn over them."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    for index, (label, losses) in enumerate(curves):
        steps = range(1, len(losses) + 1)
        under = len(curves) - 1 - index  # curves drawn after this one, over it
        style = {"linestyle": LINE_STYLES[index % len(LINE_STYLES)], "linewidth": 1.2 + 0.8 * under}
        if len(losses) < SMOOTH_FROM_STEPS:
            ax.plot(steps, losses, label=label, marker=MARKERS[index % len(MARKERS)], markersize=3 + 1.5 * under,
                    alpha=0.85, **style)
            continue
        raw = ax.plot(steps, losses, linewidth=0.8, alpha=0.25)[0]
        span = max(5, len(losses) // 20)
        ax.plot(steps, ema(losses, span), label=f"{label} (EMA, span {span} steps)", color=raw.get_color(), **style)
    if evals:
        ax.plot(*zip(*evals), label="held-out (eval)", color="#c44e52", marker="s", markersize=5, linewidth=1.2,
                linestyle="--")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training and held-out loss (global mean)" if evals else "training loss (global mean)")
    _title(ax, title)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    return fig


def step_times_figure(first_step: int, step_ms: Sequence[float], timing_warmup: int, title: str,
                      earlier: Sequence[tuple[int, float]] = ()):
    """One run's step time at every step this process ran (counted from `first_step`), its
    first `timing_warmup` steps marked as the warm-up the statistics leave out, and the
    median of the others as a line. `earlier`, (step, ms) of the steps a resumed run ran
    before (its log's), are drawn before them in grey: the statistics are this process's."""
    from matplotlib.ticker import MaxNLocator

    fig, ax = _figure()
    if earlier:
        ax.plot(*zip(*earlier), color="#999999", marker="o", markersize=3, linewidth=1.2, label="before the resume")
        ax.axvline(first_step - 0.5, color="#999999", linewidth=1, linestyle=":")
    steps = list(range(first_step, first_step + len(step_ms)))
    ax.plot(steps, step_ms, color="#4c72b0", marker="o", markersize=3, linewidth=1.2, label="step")
    if timing_warmup:
        ax.plot(steps[:timing_warmup], step_ms[:timing_warmup], color="#c44e52", marker="o", markersize=3,
                linewidth=0, label="warm-up (not in the statistics)")
    if step_ms[timing_warmup:]:
        median = statistics.median(step_ms[timing_warmup:])
        ax.axhline(median, color="#555555", linewidth=1, linestyle="--", label=f"median {median:.1f} ms")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max([*step_ms, *(ms for _, ms in earlier)]) * 1.1 if step_ms else 1)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    _title(ax, title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def expert_load_figure(tokens_per_expert_YE: Sequence[Sequence[int]], title: str):
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
    _title(ax, title)
    return fig
