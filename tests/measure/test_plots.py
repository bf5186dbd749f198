"""The plots (te_mixtral/measure/plots.py), read back from the figure objects: a results
page's long titles stay inside the picture, identical curves stay told apart, a long run gets
a smoothed line over its faint raw one, and a resumed run's step-time plot covers the steps
before the resume, read from its log."""

import pandas as pd
import pytest

from te_mixtral.config import load_config
from te_mixtral.measure import plots, run_log

pytest.importorskip("matplotlib")

# As a results page titles its plots (results/pages.py): what, then how it was made.
PAGE_TITLE = ("Training loss per step, NVIDIA H100 80GB HBM3 x 1\n2026-11-23, python 3.12.3, torch 2.11.0, "
              "transformers 5.17.0, triton 3.6.0, transformer_engine 2.20.2\nruns and their commands: "
              "2026-11-23-h100-80gb-hbm3-x1-fp8.md (python -m te_mixtral.results.pages)")


def drawn(fig):
    """The figure after it is rendered as `plots.save` renders it, with Agg (layout and
    wrapping happen then)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).draw()
    return fig


def inside_the_picture(fig, artist) -> bool:
    box, frame = artist.get_window_extent(fig.canvas.get_renderer()), fig.bbox
    return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1


def test_long_titles_are_not_clipped():
    curves = [("loop", [3.0, 2.0, 1.5]), ("custom_grouped", [3.0, 2.1, 1.4])]
    figures = [plots.loss_figure(curves, PAGE_TITLE),
               plots.step_time_figure(["loop", "custom_grouped"], [10.0, 5.0], [12.0, 6.0], PAGE_TITLE),
               plots.step_times_figure(1, [10.0, 9.0, 9.5], 1, PAGE_TITLE),
               plots.expert_load_figure([[1, 2, 3, 4], [4, 3, 2, 1]], PAGE_TITLE)]
    for fig in map(drawn, figures):
        (ax, *_) = fig.axes
        assert inside_the_picture(fig, ax.title)
        assert inside_the_picture(fig, ax)  # room made for the title's lines, not taken from beside it


def test_identical_curves_stay_visible():
    losses = [3.0, 2.5, 2.0, 1.8]
    fig = plots.loss_figure([(name, losses) for name in ("loop", "grouped_linear", "custom_grouped")], "t")
    lines = fig.axes[0].get_lines()
    assert len(lines) == 3
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 3
    assert len({line.get_linestyle() for line in lines}) == 3
    # Each drawn narrower than the one under it: the first shows around the later ones.
    for size in (lambda line: line.get_linewidth(), lambda line: line.get_markersize()):
        sizes = [size(line) for line in lines]
        assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 3


def test_a_long_run_gets_a_smoothed_line_over_its_faint_raw_one():
    long = [5.0 / (1 + 0.02 * step) + 0.3 * ((step * 7919) % 13 - 6) / 6 for step in range(300)]
    fig = plots.loss_figure([("loop", long), ("short", [2.0, 1.0])], "t")
    raw, smooth, short = fig.axes[0].get_lines()
    assert list(raw.get_ydata()) == long and raw.get_alpha() < 0.5 and not raw.get_label().startswith("loop")
    span = 300 // 20
    assert smooth.get_ydata() == pytest.approx(pd.Series(long).ewm(span=span).mean().tolist(), rel=1e-12)
    assert smooth.get_label() == f"loop (EMA, span {span} steps)" and smooth.get_color() == raw.get_color()
    assert list(short.get_ydata()) == [2.0, 1.0] and short.get_label() == "short"  # a short run: raw, as it was


def test_a_resumed_runs_step_times_cover_the_whole_run(tmp_path, monkeypatch):
    """Through the run log: a run of 6 steps resumed from the checkpoint after step 3."""
    figures = {}
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.setdefault(path.name, fig))
    cfg = load_config(None, {"steps": "6", "output_dir": str(tmp_path)})
    state = lambda loss: type("State", (), {"losses": [loss], "grad_norms": [0.5], "router": [  # noqa: E731
        {"aux": 1.0, "z": 2.0, "max_over_mean": 1.5, "busiest_rank_over_mean": {}}]})
    log = run_log.RunLog(tmp_path, cfg, first_step=1, total=6)
    for step in (1, 2, 3, 4):  # step 4 ran, but the run died before its checkpoint
        log.step(step, state(9.0 - step), 1e-3, 0.01 * step, 2**30, print_line=False)
    cfg.resume = True
    resumed = run_log.RunLog(tmp_path, cfg, first_step=4, total=6)
    for step in (4, 5, 6):
        resumed.step(step, state(9.0 - step), 1e-3, 0.02, 2**30, print_line=False)
    resumed.finish([9.0 - step for step in range(1, 7)], 4, [0.02] * 3, 1, "title")

    ax = drawn(figures[run_log.STEP_TIME_PLOT]).axes[0]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["before the resume"].get_xdata()) == [1, 2, 3]
    assert lines["before the resume"].get_ydata() == pytest.approx([10.0, 20.0, 30.0])
    assert list(lines["step"].get_xdata()) == [4, 5, 6]
    assert ax.get_xlim()[0] < 1 and ax.get_ylim()[1] >= 30.0
