"""Experiment trackers (te_mixtral/measure/trackers.py): one short run reports to Weights &
Biases (offline) and MLflow (a file: store) and each holds steps.jsonl's scalars, step for
step, read back with the tracker's own reader (TensorBoard's: tests/measure/test_run_log.py).
Then `report_to`'s values, the old `tensorboard` key, and a missing package."""

import importlib.util
import json
import struct

import pytest
import yaml
from launch import run_cli

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


def wandb_history(run_dir) -> list[dict]:
    """The history rows of an offline wandb run, as `wandb sync` would send them."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    rows = []
    for data in wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows


@pytest.mark.slow  # wandb starts a service process of its own
@pytest.mark.skipif(not (importlib.util.find_spec("wandb") and importlib.util.find_spec("mlflow")),
                    reason="needs wandb and mlflow (pip install -e '.[wandb,mlflow]')")
def test_wandb_and_mlflow_get_the_scalars_of_every_step(tmp_path, monkeypatch):
    import mlflow

    out, store = tmp_path / "run", tmp_path / "mlruns"
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_CONSOLE", "off")  # wandb would wrap the test's captured stdout
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{store}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps file stores for those who ask
    proc = run_cli([*ARGS, "--report-to", "wandb,mlflow", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in (out / run_log.STEPS_FILE).read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    evals = [(line["step"], line["eval_loss"]) for line in lines if "eval_loss" in line]
    assert len(steps) == STEPS and len(evals) == 2

    history = wandb_history(out)
    for tag, field in TAGS.items():
        assert [(row["_step"], row[tag]) for row in history if tag in row] == [(r["step"], r[field]) for r in steps]
    assert [(row["_step"], row["loss/eval"]) for row in history if "loss/eval" in row] == evals

    client = mlflow.tracking.MlflowClient(f"file:{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("te_mixtral").experiment_id])
    assert run.info.run_name == out.name and run.data.params["train.steps"] == str(STEPS)
    for tag, field in TAGS.items():
        metrics = sorted(client.get_metric_history(run.info.run_id, tag), key=lambda m: m.step)
        assert [(m.step, m.value) for m in metrics] == [(r["step"], pytest.approx(r[field], rel=1e-12))
                                                        for r in steps], tag
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "loss/eval")] == evals


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
