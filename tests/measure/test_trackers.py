"""Experiment trackers (te_mixtral/measure/trackers.py): one short run reports to Weights &
Biases (offline) and MLflow (a file: store), and its resume from its checkpoint goes on in the
same run of each: one run holds steps.jsonl's scalars of both halves, step for step, read back
with the tracker's own reader (TensorBoard's: tests/measure/test_run_log.py). A run that died
past its checkpoint: MLflow is not sent its steps again. Then `report_to`'s values, the old
`tensorboard` key, and a missing package."""

import importlib.util
import json
import os
import struct
from unittest import mock

import pytest
import yaml
from launch import run_cli
from test_run_log import fake_state

from te_mixtral.config import load_config
from te_mixtral.errors import UserError
from te_mixtral.measure import run_log, trackers

STEPS = 3
ARGS = ["--steps", str(STEPS), "--timing_warmup_steps", "1", "--seq_len", "64", "--max_documents", "60",
        "--eval-fraction", "0.1", "--eval-every", "2"]
TAGS = {"loss/train": "loss", "loss/aux": "aux_loss", "optim/lr": "lr", "optim/grad_norm": "grad_norm",
        "speed/step_ms": "step_ms", "memory/peak_gib": "peak_memory_gib"}


def wandb_records(path) -> list[bytes]:
    """The records of a .wandb file: LevelDB's log format (what wandb's Python SDK read with
    its `datastore` module until the reader moved into its Go core): a 7-byte header
    (":W&B", magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each a 7-byte header
    (crc32c, length uint16, type: 1 whole, 2 first, 3 middle, 4 last) and its bytes; a block's
    tail shorter than a chunk header is padding."""
    data, block = path.read_bytes(), 32768
    assert data[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0)
    records, pending, offset = [], b"", 7
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # padding to the next block
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        chunk, offset = data[offset + 7:offset + 7 + length], offset + 7 + length
        if kind in (1, 2):
            pending = b""
        pending += chunk
        if kind in (1, 4):
            records.append(pending)
    return records


def wandb_history(run_dir) -> tuple[str, list[dict]]:
    """The run id and the history rows of the offline wandb run in `run_dir`, as `wandb sync`
    would send them (it sends the files of one run id into that one run, in order)."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    run_ids, rows = [], []
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "run":
            run_ids.append(record.run.run_id)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    (run_id,) = set(run_ids)
    return run_id, rows


def log_lines(*folders) -> tuple[list[dict], list[tuple[int, float]]]:
    """The training steps' lines and the (step, held-out loss) pairs of the runs' steps.jsonl."""
    lines = [json.loads(line) for out in folders for line in (out / run_log.STEPS_FILE).read_text().splitlines()]
    return [line for line in lines if "loss" in line], [(line["step"], line["eval_loss"]) for line in lines
                                                         if "eval_loss" in line]


@pytest.mark.slow  # wandb starts a service process of its own
@pytest.mark.skipif(not (importlib.util.find_spec("wandb") and importlib.util.find_spec("mlflow")),
                    reason="needs wandb and mlflow (pip install -e '.[wandb,mlflow]')")
def test_wandb_and_mlflow_get_every_step_and_a_resume_goes_on_in_the_same_run(tmp_path, monkeypatch):
    """The README's resume: a run checkpoints, and a later one trains further from that
    checkpoint (into a new output folder, as the default `runs/<time>-<tier>` is)."""
    import mlflow

    first, resumed, store, ckpt = tmp_path / "first", tmp_path / "resumed", tmp_path / "mlruns", tmp_path / "ckpt"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # wandb would wrap the test's captured stdout
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{store}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores for those who ask
    common = [*ARGS, "--report-to", "wandb,mlflow", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    proc = run_cli([*common, "--steps", "2", "--output-dir", str(first)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_cli([*common, "--steps", "4", "--resume", "--output-dir", str(resumed)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not [line for line in proc.stdout.splitlines() if "note:" in line and "changed since" not in line], proc.stdout
    steps, evals = log_lines(first, resumed)
    assert [line["step"] for line in steps] == [1, 2, 3, 4] and [s for s, _ in evals] == [2, 4]

    # wandb: both halves are one run (one id), each step once.
    (first_id, first_rows), (resumed_id, resumed_rows) = wandb_history(first), wandb_history(resumed)
    assert resumed_id == first_id
    history = first_rows + resumed_rows
    for tag, field in TAGS.items():
        assert [(row["_step"], row[tag]) for row in history if tag in row] == [(r["step"], r[field]) for r in steps]
    assert [(row["_step"], row["loss/eval"]) for row in history if "loss/eval" in row] == evals

    # MLflow: one run, its parameters those it started with; each step once.
    client = mlflow.tracking.MlflowClient(f"file:{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("te_mixtral").experiment_id])
    assert run.info.run_name == first.name and run.data.params["train.steps"] == "2"
    for tag, field in TAGS.items():
        metrics = sorted(client.get_metric_history(run.info.run_id, tag), key=lambda m: m.step)
        assert [(m.step, m.value) for m in metrics] == [(r["step"], pytest.approx(r[field], rel=1e-12))
                                                        for r in steps], tag
    assert sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss/eval")) == evals


def test_report_to_names_trackers(tmp_path):
    assert trackers.requested(load_config(None, {"report-to": "tensorboard, wandb"})) == ["tensorboard", "wandb"]
    assert trackers.requested(load_config(None, {})) == []
    for bad in ("wandb,comet", "none,wandb", ""):
        with pytest.raises(UserError, match="report_to must be none or any of tensorboard, wandb, mlflow"):
            load_config(None, {"report_to": bad})
    # Twice would start it twice: every step twice in TensorBoard, a second MLflow run refused.
    with pytest.raises(UserError, match="report_to names tensorboard twice"):
        load_config(None, {"report_to": "tensorboard,wandb, tensorboard"})
    # The old switch, on the command line and in a config file, is report_to tensorboard.
    assert load_config(None, {"tensorboard": "true"}).report_to == "tensorboard"
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump({"tensorboard": False}))
    assert load_config(str(old)).report_to == "none"
    old.write_text(yaml.safe_dump({"tensorboard": True, "report_to": "wandb"}))
    with pytest.raises(UserError, match="sets both 'tensorboard' and 'report_to'"):
        load_config(str(old))


def test_a_missing_tracker_package_is_named_with_its_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in trackers.PACKAGES
                        else real(name, *a))
    trackers.check_trackers(load_config(None, {}))  # the default run needs none of them
    for name in trackers.PACKAGES:
        with pytest.raises(UserError, match=rf"^report_to {name} needs the {name} package: pip install "
                                            rf"'te_mixtral\[{name}\]'$"):
            trackers.check_trackers(load_config(None, {"report_to": f"{name}"}))


@pytest.mark.skipif(not importlib.util.find_spec("mlflow"), reason="needs mlflow (pip install -e '.[mlflow]')")
def test_a_tracker_that_cannot_start_leaves_no_log_behind(tmp_path, monkeypatch):
    """Refused before step 1, the run leaves no steps.jsonl: an empty one would make the next
    run into the folder read as one that did not finish (and be refused, as needing --resume)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'a_file' / 'mlruns'}")  # under a file: unusable
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(UserError, match="report_to mlflow could not start"):
        run_log.RunLog(tmp_path, load_config(None, {"report_to": "mlflow"}), first_step=1, total=3)
    assert not (tmp_path / run_log.STEPS_FILE).exists()


@pytest.fixture
def mlflow_store(tmp_path):
    """A client of an MLflow file store in `tmp_path`, which the runs' trackers use too. The
    environment is put back after: mlflow.set_experiment sets MLFLOW_EXPERIMENT_ID in it."""
    mlflow = pytest.importorskip("mlflow")
    with mock.patch.dict(os.environ, {"MLFLOW_TRACKING_URI": f"file:{tmp_path / 'mlruns'}",
                                      "MLFLOW_ALLOW_FILE_STORE": "true"}):
        yield mlflow.tracking.MlflowClient(f"file:{tmp_path / 'mlruns'}")
        while mlflow.active_run():  # a test that failed half way leaves none for the next
            mlflow.end_run()


def test_mlflow_is_not_sent_again_the_steps_a_dead_run_logged_past_its_checkpoint(tmp_path, mlflow_store, capsys):
    """MLflow keeps every value it is sent, one more at a step it holds: the resumed run sends
    none of the steps the run already holds (the dead run's, of the same computation), as
    TensorBoard hides them behind the resumed run's and steps.jsonl drops their lines."""
    import mlflow

    cfg = load_config(None, {"steps": "5", "output_dir": str(tmp_path / "out"), "report_to": "mlflow"})
    (tmp_path / "out").mkdir()
    dead = run_log.RunLog(tmp_path / "out", cfg, first_step=1, total=5)
    for step in (1, 2, 3):  # its checkpoint after step 2, then step 3 logged, and it dies
        dead.step(step, fake_state(10.0 - step), 1e-3, 0.1, 2**30, print_line=False)
    saved = dead.tracker_runs
    mlflow.end_run("KILLED")  # what the dead process left running, in this one
    cfg.resume = True
    resumed = run_log.RunLog(tmp_path / "out", cfg, first_step=3, total=5, saved_runs=saved)
    assert resumed.tracker_runs == saved
    for step in (3, 4):
        resumed.step(step, fake_state(0.5 - step / 10), 1e-3, 0.1, 2**30, print_line=False)
    resumed.finish([9.0, 8.0, 0.2, 0.1], 3, [0.1, 0.1], 0, "title")
    (run,) = mlflow_store.search_runs([mlflow_store.get_experiment_by_name("te_mixtral").experiment_id])
    assert run.info.run_id == saved["mlflow"]
    history = sorted((m.step, m.value) for m in mlflow_store.get_metric_history(run.info.run_id, "loss/train"))
    assert history == [(1, 9.0), (2, 8.0), (3, 7.0), (4, pytest.approx(0.1))]
    assert "note:" not in capsys.readouterr().out


def test_a_resume_whose_checkpoint_names_no_run_there_starts_one_and_says_so(tmp_path, mlflow_store, capsys):
    """A checkpoint written without the tracker (or before run ids were kept), or whose run its
    store does not hold (another MLFLOW_TRACKING_URI; deleted): a new run, said in one line.
    A run the checkpoint names for a tracker this run does not report to is kept for later."""
    cfg = load_config(None, {"steps": "5", "output_dir": str(tmp_path), "report_to": "mlflow", "resume": "true",
                             "checkpoint_dir": str(tmp_path / "ckpt")})
    deleted = mlflow_store.create_run(mlflow_store.create_experiment("elsewhere")).info.run_id
    mlflow_store.delete_run(deleted)
    for saved, why in (({}, "the checkpoint names no mlflow run"),
                       ({"mlflow": "0" * 32}, f"the checkpoint's mlflow run {'0' * 32} is not in"),
                       ({"mlflow": deleted}, f"the checkpoint's mlflow run {deleted} was deleted")):
        log = run_log.RunLog(tmp_path, cfg, first_step=3, total=5, saved_runs={**saved, "wandb": "w1"})
        log.step(3, fake_state(1.0), 1e-3, 0.1, 2**30, print_line=False)
        log.finish([1.0] * 3, 3, [0.1], 0, "title")
        out = capsys.readouterr().out
        notes = [line for line in out.splitlines() if line.startswith("te_mixtral: note:")]
        assert len(notes) == 2 and why in notes[0] and "starting a new one" in notes[0], out
        assert "the checkpoint's wandb run w1 is not continued: report_to does not name wandb" in notes[1], out
        assert log.tracker_runs["mlflow"] not in (None, "0" * 32, deleted) and log.tracker_runs["wandb"] == "w1"
        (tmp_path / run_log.STEPS_FILE).unlink()
