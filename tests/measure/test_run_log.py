"""The run log (te_mixtral/measure/run_log.py): steps.jsonl written as the run goes and equal
to results.json, TensorBoard's scalars, the plots, the console lines and the versions in
the header; all from one short run, read while it trains and after. Then the log's file
rules and its missing-package paths. All in process."""

import importlib.metadata
import importlib.util
import json
import statistics
from types import SimpleNamespace
from unittest import mock

import pytest
import transformers
import triton
from conftest import REPO
from launch import run_cli

from te_mixtral.config import load_config
from te_mixtral.errors import UserError
from te_mixtral.measure import run_log
from te_mixtral.measure.trackers import check_trackers
from te_mixtral.training.optimizer import learning_rate
from te_mixtral.training.outputs import check_outputs

# What a header records: the installed distribution's version (its metadata), which on some images
# lacks the local "+cu130" that torch.__version__ carries.
TORCH_VERSION = importlib.metadata.version("torch")

STEPS, SEQ_LEN, BATCH = 6, 64, 4
ARGS = ["--steps", str(STEPS), "--timing_warmup_steps", "2", "--seq_len", str(SEQ_LEN), "--batch_size", str(BATCH),
        "--log_every", "2", "--max_documents", "60", "--eval-fraction", "0.05", "--eval-every", "3"]
FIELDS = {"run_id", "step", "loss", "aux_loss", "z_loss", "lr", "grad_norm", "step_ms", "tokens_per_s", "peak_memory_gib",
          "expert_load"}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The short run, in this process (`run_cli`: nothing here needs a process of its own);
    what steps.jsonl held, read from the disk as any other reader reads it, once step 2 was
    logged; its stdout and stderr."""
    out = tmp_path_factory.mktemp("run")
    during = {}
    log_step = run_log.RunLog.step

    def step_then_read(log, step, *args, **kwargs):
        log_step(log, step, *args, **kwargs)
        if step == 2 and not during:
            # Steps 3..6, an evaluation, results.json and the plots are still to come.
            during.update(lines=(out / run_log.STEPS_FILE).read_text().splitlines(),
                          results=(out / "results.json").exists())

    with mock.patch.object(run_log.RunLog, "step", step_then_read):
        proc = run_cli([*ARGS, "--tensorboard", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, during or None, proc.stdout, proc.stderr


def test_steps_jsonl_is_written_as_the_run_goes(run):
    _, during, _, _ = run
    assert during is not None and not during["results"]
    assert [json.loads(line)["step"] for line in during["lines"]][:2] == [1, 2]


def test_steps_jsonl_has_every_step_and_equals_results(run):
    out, _, _, _ = run
    lines = [json.loads(line) for line in (out / run_log.STEPS_FILE).read_text().splitlines()]
    records = [r for r in lines if "loss" in r]
    results = json.loads((out / "results.json").read_text())
    # Each evaluation: a line of its own, right after its step's, as results.json holds it.
    evals = [(lines[i - 1]["step"], r) for i, r in enumerate(lines) if "eval_loss" in r]
    assert [(before, r["step"], r["eval_loss"], r["eval_perplexity"], r["eval_targets"]) for before, r in evals] == [
        (e["step"], e["step"], e["loss"], e["perplexity"], e["targets"]) for e in results["evals"]]
    assert [e["step"] for e in results["evals"]] == [3, 6]
    cfg = load_config(REPO / "configs" / "tiny.yaml", {key.lstrip("-"): value for key, value in zip(ARGS[::2], ARGS[1::2])})
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(set(r) == FIELDS for r in records)
    assert [r["loss"] for r in records] == results["losses"]
    assert [r["aux_loss"] for r in records] == results["aux_losses"]
    assert [r["z_loss"] for r in records] == results["z_losses"]
    assert [r["grad_norm"] for r in records] == results["grad_norms"]
    load = results["expert_load"]
    assert [r["expert_load"]["max_over_mean"] for r in records] == load["max_over_mean"]
    for p, ratios in load["busiest_rank_over_mean"].items():
        assert [r["expert_load"]["busiest_rank_over_mean"][p] for r in records] == ratios
    assert [r["lr"] for r in records] == [learning_rate(step, cfg) for step in range(STEPS)]
    # The step times are the ones the summary's statistics are made of.
    step_ms = [r["step_ms"] for r in records]
    assert statistics.median(step_ms[2:]) == pytest.approx(results["summary"]["median_step_ms"], rel=1e-12)
    for r in records:
        assert r["tokens_per_s"] * r["step_ms"] / 1e3 == pytest.approx(BATCH * SEQ_LEN, rel=1e-9)
    memory = [r["peak_memory_gib"] for r in records]
    assert 0 < memory[0] and memory == sorted(memory)  # a peak so far never goes down
    assert memory[-1] <= results["summary"]["peak_memory_gib"]


def test_tensorboard_holds_the_same_scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, _, _, _ = run
    records = [json.loads(line) for line in (out / run_log.STEPS_FILE).read_text().splitlines()]
    records = [r for r in records if "loss" in r]  # the steps' lines, not the evaluations'
    results = json.loads((out / "results.json").read_text())
    events = EventAccumulator(str(out))
    events.Reload()
    for tag, field in (("loss/train", "loss"), ("loss/aux", "aux_loss"), ("optim/lr", "lr"),
                       ("optim/grad_norm", "grad_norm"), ("speed/step_ms", "step_ms")):
        scalars = events.Scalars(tag)
        assert [s.step for s in scalars] == list(range(1, STEPS + 1)), tag
        assert [s.value for s in scalars] == pytest.approx([r[field] for r in records], rel=1e-6), tag  # float32
    assert "expert_load/busiest_rank_over_mean_ep2" in events.Tags()["scalars"]
    evals = events.Scalars("loss/eval")
    assert [(s.step, pytest.approx(s.value, rel=1e-6)) for s in evals] == [(e["step"], e["loss"])
                                                                         for e in results["evals"]]


def test_plots_console_and_versions(run):
    out, _, stdout, stderr = run
    for name in (run_log.LOSS_PLOT, run_log.STEP_TIME_PLOT):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    # Every log_every steps a plain line; no bar: stderr is not a terminal.
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("step ")] == ["2/6", "4/6", "6/6"]
    assert "step/s" not in stderr and "s/step" not in stderr
    versions = json.loads((out / "results.json").read_text())["header"]["versions"]
    te = "not installed" if importlib.util.find_spec("transformer_engine") is None else versions["transformer_engine"]
    assert versions == {"python": versions["python"], "torch": TORCH_VERSION,
                        "transformers": transformers.__version__, "triton": triton.__version__,
                        "transformer_engine": te}
    assert f"transformers {transformers.__version__}, triton {triton.__version__}" in stdout
    assert f"transformer_engine {te}" in stdout


# --- in process: the file rules and the missing packages --------------------------------------


def fake_state(loss: float):
    router = {"aux": 1.0, "z": 2.0, "max_over_mean": 1.5, "busiest_rank_over_mean": {"2": 1.25}}
    return SimpleNamespace(losses=[loss], router=[router], grad_norms=[0.5])


def test_resume_keeps_the_earlier_steps_and_drops_the_rest(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = load_config(None, {"steps": "5", "output_dir": str(tmp_path), "report_to": "tensorboard"})
    log = run_log.RunLog(tmp_path, cfg, first_step=1, total=5)
    for step in (1, 2, 3):
        log.step(step, fake_state(10.0 - step), 1e-3, 0.1, 2**30, print_line=False)
        # Flushed line by line: another reader sees each step as soon as it is logged.
        assert len((tmp_path / run_log.STEPS_FILE).read_text().splitlines()) == step
    with open(tmp_path / run_log.STEPS_FILE, "a") as f:
        f.write('{"step": 4, "lo')  # the line a killed run was writing
    with pytest.raises(UserError, match="steps.jsonl of a run that did not finish"):
        check_outputs(cfg, None)
    cfg.resume = True
    check_outputs(cfg, None)
    resumed = run_log.RunLog(tmp_path, cfg, first_step=3, total=5)  # from the checkpoint after step 2
    resumed.step(3, fake_state(0.25), 1e-3, None, 2**30, print_line=False)
    records = [json.loads(line) for line in (tmp_path / run_log.STEPS_FILE).read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 9.0), (2, 8.0), (3, 0.25)]
    assert records[-1]["step_ms"] is None and records[-1]["tokens_per_s"] is None  # a diverged step
    # TensorBoard too: the killed run's step 3 is hidden behind the resumed run's (its events stay
    # in their file; the resumed run's marks where they stop counting).
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("loss/train")] == [(1, 9.0), (2, 8.0), (3, 0.25)]


def test_loss_plot_shows_the_held_out_losses(tmp_path):
    pytest.importorskip("matplotlib")
    drawn = {}
    for name, evals in (("without", []), ("with", [{"step": 2, "loss": 8.5}, {"step": 4, "loss": 7.5}])):
        folder = tmp_path / name
        folder.mkdir()
        log = run_log.RunLog(folder, load_config(None, {"steps": "4", "output_dir": str(folder)}), 1, 4)
        for step in range(1, 5):
            log.step(step, fake_state(10.0 - step), 1e-3, 0.1, 2**30, print_line=False)
        log.finish([9.0, 8.0, 7.0, 6.0], 1, [0.1] * 4, 0, "title", evals)
        drawn[name] = (folder / run_log.LOSS_PLOT).read_bytes()
    assert drawn["with"] != drawn["without"]  # the same training curve; the evaluations drawn over it


def test_missing_packages(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "matplotlib") else real(name, *a))
    with pytest.raises(UserError, match=r"report_to tensorboard needs the tensorboard package: pip install"):
        check_trackers(load_config(None, {"tensorboard": "true"}))
    cfg = load_config(None, {"output_dir": str(tmp_path)})
    log = run_log.RunLog(tmp_path, cfg, first_step=1, total=1)
    log.step(1, fake_state(1.0), 1e-3, 0.1, 2**30, print_line=False)
    log.finish([1.0], 1, [0.1], 0, "title")
    assert "matplotlib is not installed, so no plots" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == [run_log.STEPS_FILE]
