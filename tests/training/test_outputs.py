"""A run never deletes or replaces what is in the folders it writes to, unless it is its own
to replace or the user passes --overwrite; refusals come before any training."""

import pytest
from launch import assert_one_line_error, run_cli

from te_mixtral.config import load_config
from te_mixtral.errors import UserError
from te_mixtral.training.outputs import EXPORT_MARKER, check_outputs

SHORT = ["--steps", "2", "--timing_warmup_steps", "1", "--seq_len", "64"]


def refused(proc, *fragments):
    assert_one_line_error(proc, *fragments)
    assert "step    1/2" not in proc.stdout  # refused before training


@pytest.mark.slow
def test_export_keeps_a_folder_of_user_files_and_replaces_only_an_earlier_export(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    refused(run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "a")]),
            "not an earlier te_mixtral export")
    assert (folder / "notes.txt").read_text() == "mine" and len(list(folder.iterdir())) == 1

    (folder / "notes.txt").unlink()
    for out in ("b", "c"):  # an empty folder, then the earlier export itself, may be written
        proc = run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / out)])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (folder / EXPORT_MARKER).is_file() and (folder / "config.json").is_file()

    (folder / "notes.txt").write_text("mine")
    (folder / EXPORT_MARKER).unlink()
    proc = run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "d"), "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (folder / "notes.txt").exists()  # replaced, as asked


def test_export_never_replaces_the_current_checkpoint_or_model_folder(tmp_path, monkeypatch):
    ckpt, model = tmp_path / "ckpt", tmp_path / "models" / "mixtral"
    model.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    for save_hf, what in [(".", "the current folder"), (str(tmp_path), "the current folder"),
                          (str(ckpt), "the checkpoint folder"), (str(model), "the --model folder"),
                          (str(tmp_path / "models"), "the --model folder")]:
        cfg = load_config(None, {"save_hf": save_hf, "checkpoint_dir": str(ckpt), "overwrite": "true"})
        with pytest.raises(UserError, match=f"would replace {what}"):
            check_outputs(cfg, model)


@pytest.mark.slow
def test_a_new_run_keeps_an_earlier_runs_checkpoints(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = run_cli([*SHORT, "--checkpoint-dir", str(ckpt), "--output-dir", str(tmp_path / "a")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = sorted(p.name for p in ckpt.iterdir())
    refused(run_cli([*SHORT, "--checkpoint-dir", str(ckpt), "--output-dir", str(tmp_path / "b")]),
            "holds an earlier run's checkpoints", "--resume")
    assert sorted(p.name for p in ckpt.iterdir()) == saved
    proc = run_cli([*SHORT, "--checkpoint-dir", str(ckpt), "--output-dir", str(tmp_path / "c"), "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow
def test_an_output_folder_holding_a_run_is_kept(tmp_path):
    out = tmp_path / "out"
    assert run_cli([*SHORT, "--output-dir", str(out)]).returncode == 0
    before = (out / "results.json").read_bytes()
    refused(run_cli([*SHORT, "--output-dir", str(out), "--lr", "1e-3"]), "already holds a run's results.json")
    assert (out / "results.json").read_bytes() == before
    assert run_cli([*SHORT, "--output-dir", str(out), "--lr", "1e-3", "--overwrite"]).returncode == 0
    assert (out / "results.json").read_bytes() != before
