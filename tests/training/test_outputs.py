"""A run never deletes or replaces what is in the folders it writes to, unless it is its own
to replace or the user passes --overwrite; refusals come before any training."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from hf_reference import random_hf_mixtral
from launch import assert_one_line_error, run_cli

from te_mixtral import files
from te_mixtral.config import load_config, save_config
from te_mixtral.errors import ExitCode, UserError
from te_mixtral.files import replace_files, require_free_space, size_text
from te_mixtral.folder_lock import LOCK_FILE, FolderLocks, lock_path
from te_mixtral.training.outputs import (
    CHAT_TEMPLATES_DIR,
    EXPORT_MARKER,
    check_outputs,
    is_export_file,
    output_files,
)

SHORT = ["--steps", "2", "--timing_warmup_steps", "1", "--seq_len", "64"]
# LoRA adapters export over a base a file holds (--model): a hub id's name for the checks that
# read the config alone (nothing is downloaded), a tiny checkpoint folder for runs (`lora_base`).
LORA = {"lora.rank": "4", "model_path": "mistralai/Mixtral-8x7B-v0.1"}


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory) -> list[str]:
    """The arguments of a LoRA run over a tiny random checkpoint (its vocabulary holds the BPE
    the run trains on the default data)."""
    folder = tmp_path_factory.mktemp("base")
    random_hf_mixtral(vocab_size=2048, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, num_local_experts=2, num_experts_per_tok=1).save_pretrained(folder)
    return ["--lora.rank", "4", "--model", str(folder)]


def refused(proc, *fragments):
    assert_one_line_error(proc, *fragments)
    assert "step    1/2" not in proc.stdout  # refused before training


def test_an_export_replaces_only_the_files_an_export_writes(tmp_path):
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "README.md").write_text("my model card")
    (folder / "config.json").write_text("{}")  # an export's name, not from an export
    refused(run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "a")]),
            "holds config.json, which the export would replace")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json"]

    (folder / "config.json").unlink()
    proc = run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "b")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (folder / EXPORT_MARKER).is_file() and (folder / "config.json").is_file()
    # An earlier export, laid out in more files: what it wrote goes, what the user wrote stays
    # (another run's export is replaced only with --overwrite, the user's files kept even so).
    stale = folder / "model-00009-of-00009.safetensors"
    stale.write_text("from an earlier export")
    (folder / "eval_results.json").write_text("{}")
    proc = run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "c"), "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not stale.exists() and not (tmp_path / "export.old").exists()
    assert (folder / "README.md").read_text() == "my model card" and (folder / "eval_results.json").is_file()
    assert all(is_export_file(p.name) for p in folder.iterdir() if p.name not in ("README.md", "eval_results.json"))


@pytest.mark.parametrize("key", ["--save-hf", "--save-adapter"])
def test_a_finished_export_holds_what_its_readers_need_and_its_marker_alone(tmp_path, key, lora_base):
    # Users push an export to the hub with huggingface_hub.upload_folder, which uploads hidden
    # files too. Before, it uploaded the run's lock (.te_mixtral.lock, a note of the pid and host
    # that held the folder) with the export.
    from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects

    export = tmp_path / "export"
    lora = lora_base if key == "--save-adapter" else []
    proc = run_cli([*SHORT, "--output-dir", str(tmp_path / "out"), key, str(export), *lora])
    assert proc.returncode == 0, proc.stderr[-2000:]
    files_in = [p.relative_to(export).as_posix() for p in sorted(export.glob("**/*")) if p.is_file()]
    uploaded = set(filter_repo_objects(files_in, ignore_patterns=DEFAULT_IGNORE_PATTERNS))  # as upload_folder picks
    if key == "--save-hf":  # what transformers reads: the weights its index names, the config, the tokenizer
        index = json.loads((export / "model.safetensors.index.json").read_text())
        read = {"config.json", "model.safetensors.index.json", *index["weight_map"].values()}
    else:  # what PEFT reads, and the tokenizer the adapters learnt (training/peft_adapters.py)
        read = {"adapter_config.json", "adapter_model.safetensors"}
    assert uploaded == read | {"tokenizer.json", "tokenizer_config.json", EXPORT_MARKER}
    assert set(files_in) == uploaded
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "out"]  # nothing of the run's left beside it
    # Shared as the run's other files are: safetensors writes its files owner-only.
    assert [name for name in files_in if (export / name).stat().st_mode & 0o044 != 0o044] == []


def test_no_file_transformers_would_read_with_an_export_stays_beside_it(tmp_path):
    """transformers loads a folder's model.safetensors in place of the sharded index an export
    writes, and adds an added_tokens.json's tokens to the export's tokenizer: kept beside an
    export, either makes the folder load as something else than what was trained. Refused
    even beside an earlier export (which never writes them); --overwrite replaces them."""
    folder = tmp_path / "export"
    proc = run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "a")])
    assert proc.returncode == 0, proc.stderr[-2000:]
    (folder / "model.safetensors").write_bytes((folder / "model-00001-of-00003.safetensors").read_bytes())
    (folder / "added_tokens.json").write_text('{"<extra>": 2048}')
    refused(run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "b")]),
            f"save_hf {folder} holds added_tokens.json, model.safetensors, which transformers would read with the "
            f"export")
    proc = run_cli([*SHORT, "--save-hf", str(folder), "--output-dir", str(tmp_path / "c"), "--overwrite"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not (folder / "model.safetensors").exists() and not (folder / "added_tokens.json").exists()


def test_replacing_files_keeps_the_others_and_a_crash_keeps_the_earlier_set(tmp_path, monkeypatch):
    final, new = tmp_path / "final", tmp_path / "final.tmp"
    final.mkdir()
    files.make_scratch(new)  # as an export makes its temporary folder
    for name, text in [("mine.txt", "user"), ("a.bin", "old a"), ("b.bin", "old b"), (EXPORT_MARKER, "old")]:
        (final / name).write_text(text)
    for name in ("a.bin", EXPORT_MARKER):
        (new / name).write_text("new")
    owned = {"a.bin", "b.bin", EXPORT_MARKER}.__contains__
    real_rename, moved = os.rename, []

    def rename_then_die(src, dst):  # dies as the first new file comes in
        if Path(src).parent == new:
            raise KeyboardInterrupt
        moved.append(Path(src).name)
        real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename_then_die)
    with pytest.raises(KeyboardInterrupt):
        replace_files(new, final, owned, EXPORT_MARKER)
    assert moved[0] == EXPORT_MARKER  # the folder stops calling itself complete first
    old = tmp_path / "final.old"
    assert sorted(p.name for p in old.iterdir()) == sorted(["a.bin", "b.bin", EXPORT_MARKER, files.SCRATCH_MARKER])
    monkeypatch.setattr(os, "rename", real_rename)
    replace_files(new, final, owned, EXPORT_MARKER)  # the next export starts over
    assert {p.name: p.read_text() for p in final.iterdir()} == {"mine.txt": "user", "a.bin": "new",
                                                                EXPORT_MARKER: "new"}
    assert not old.exists() and not new.exists()


def test_an_exports_folder_of_named_templates_is_replaced_whole(tmp_path):
    # An export's named chat templates are a folder (additional_chat_templates/): an earlier
    # export's goes whole, with its files (before: only files moved, and the new folder could not
    # be renamed onto the earlier one), and goes where the new export has none.
    final = tmp_path / "final"
    final.mkdir()
    for templates in ({"tool_use.jinja": "new", "rag.jinja": "new"}, {}):
        (final / CHAT_TEMPLATES_DIR).mkdir(exist_ok=True)
        (final / CHAT_TEMPLATES_DIR / "old.jinja").write_text("earlier export's")
        new = tmp_path / "final.tmp"
        files.make_scratch(new)
        (new / EXPORT_MARKER).write_text("new")
        for name, text in templates.items():
            (new / CHAT_TEMPLATES_DIR).mkdir(exist_ok=True)
            (new / CHAT_TEMPLATES_DIR / name).write_text(text)
        replace_files(new, final, is_export_file, EXPORT_MARKER)
        assert sorted(p.name for p in final.rglob("*")) == sorted([EXPORT_MARKER, *templates] +
                                                                  ([CHAT_TEMPLATES_DIR] if templates else []))


@pytest.mark.parametrize("suffix", [".tmp", ".old"])
@pytest.mark.parametrize("key", ["save_hf", "save_adapter"])
def test_a_folder_named_like_an_exports_scratch_folder_is_refused_not_deleted(tmp_path, key, suffix):
    export = tmp_path / "export"
    theirs = tmp_path / f"export{suffix}"  # the user's own, named as the export's temporary or backup folder
    theirs.mkdir()
    (theirs / "model.safetensors").write_text("mine")
    cfg = load_config(None, {key: str(export), "output_dir": str(tmp_path / "out"), "overwrite": "true",
                             **(LORA if key == "save_adapter" else {})})
    with pytest.raises(UserError, match=f"{theirs} is in the way: te_mixtral writes .* and deletes it"):
        check_outputs(cfg, None)
    # Where the folder appeared after the check (during training), the export refuses too.
    new = tmp_path / "new"
    files.make_scratch(new)
    (new / EXPORT_MARKER).write_text("{}")
    export.mkdir()
    (export / EXPORT_MARKER).write_text("{}")
    with pytest.raises(UserError, match="is in the way"):
        if suffix == ".tmp":  # where an export clears its temporary folder before it writes
            files.remove_scratch(theirs, "the export")
        else:
            replace_files(new, export, is_export_file, EXPORT_MARKER)
    assert (theirs / "model.safetensors").read_text() == "mine"
    # What te_mixtral made, it deletes.
    (theirs / "model.safetensors").unlink()
    theirs.rmdir()
    files.make_scratch(theirs)
    check_outputs(cfg, None)


@pytest.mark.parametrize("key", ["output_dir", "save_hf", "save_adapter"])
def test_a_folder_the_run_writes_inside_a_checkpoint_is_refused(tmp_path, key, lora_base):
    # A save replaces step-N and `latest`, and pruning deletes step-N: a folder written there
    # would fail the save after training, or be deleted with the checkpoint.
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000002").mkdir(parents=True)
    link = tmp_path / "out"
    link.symlink_to(ckpt / "step-000002")
    for folder in (ckpt / "step-000004" / "run", link / "run", ckpt / "step-000003", ckpt / "latest"):
        cfg = load_config(None, {key: str(folder), "checkpoint_dir": str(ckpt), "resume": "true", **LORA})
        inside = ckpt / folder.resolve().relative_to(ckpt.resolve()).parts[0]
        with pytest.raises(UserError, match=re.escape(f"{key} {folder} is inside {inside}, which")):
            check_outputs(cfg, None)
    refused(run_cli([*SHORT, f"--{key}", str(ckpt / "step-000002"), "--checkpoint-dir", str(tmp_path / "ckpt"),
                     *lora_base, *(["--output-dir", str(tmp_path / "o")] if key != "output_dir" else [])]),
            f"{key} {ckpt / 'step-000002'} is inside")


@pytest.mark.parametrize("key", ["loss_check", "ep_placement", "data.dataset", "data.tokenizer", "--config"])
def test_an_input_inside_a_checkpoint_is_refused(tmp_path, key):
    # Pruning deletes a step folder whole, the user's files put in it too: a run's input
    # there would be gone when its resume or a rerun reads it again.
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-000002").mkdir(parents=True)
    (ckpt / "step-000002" / "meta.json").write_text("{}")
    (ckpt / "latest").write_text("step-000002\n")
    source = ckpt / "step-000002" / ("run.yaml" if key == "--config" else "input.json")
    source.write_text("{}")
    settings = {"checkpoint_dir": str(ckpt), "resume": "true", "output_dir": str(tmp_path / "out"),
                **({"ep_size": "2"} if key == "ep_placement" else {})}
    cfg = load_config(None, settings if key == "--config" else {**settings, key: str(source)},
                      world_size=2 if key == "ep_placement" else 1)
    with pytest.raises(UserError, match=re.escape(f"{key} {source} is inside {ckpt / 'step-000002'}, which")):
        check_outputs(cfg, None, str(source) if key == "--config" else None)


@pytest.mark.parametrize("key", ["--output-dir", "--checkpoint-dir", "--save-adapter"])
@pytest.mark.parametrize("suffix", [".tmp", ".old"])
def test_a_folder_of_the_run_named_as_an_exports_scratch_folder_is_refused(tmp_path, key, suffix, lora_base):
    # An export is written into DIR.tmp and the one it replaces moves to DIR.old, both deleted
    # after: the run's own folder of that name failed the second export (--save-every) after
    # training, 'in the way', with the advice to delete it (or, empty, was deleted).
    export = tmp_path / "export"
    folder = str(tmp_path / f"export{suffix}")
    more = [] if key == "--output-dir" else ["--output-dir", str(tmp_path / "out")]
    refused(run_cli([*SHORT, *lora_base, "--save-hf", str(export), "--save-every", "1", key, folder, *more]),
            f"{key.lstrip('-').replace('-', '_')} {folder} is where the save_hf export {export} is "
            f"{'written first' if suffix == '.tmp' else 'moved to as it is replaced'}")


def test_an_output_folder_that_is_the_data_set_folder_is_refused(tmp_path):
    # A data folder's files are all read: the run's results.json and steps.jsonl would be the
    # next run's data (which then fails to load them, or trains on them).
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "a document"}\n')
    for out in (data, tmp_path / "." / "data"):
        cfg = load_config(None, {"output_dir": str(out), "dataset": str(data)})
        with pytest.raises(UserError, match=re.escape(f"output_dir {out} is the data set folder")):
            check_outputs(cfg, None)
    check_outputs(load_config(None, {"output_dir": str(data / "run"), "dataset": str(data)}), None)  # not read


def test_export_never_writes_into_the_runs_own_folders_or_inputs(tmp_path, monkeypatch):
    ckpt, model, out = tmp_path / "ckpt", tmp_path / "models" / "mixtral", tmp_path / "runs" / "a"
    model.mkdir(parents=True)
    data = tmp_path / "corpus" / "train.jsonl"  # a folder of data files would read the export as data
    data.parent.mkdir()
    data.write_text('{"text": "hello"}\n')
    monkeypatch.chdir(tmp_path)
    for save_hf, what in [(".", "the current folder"), (str(tmp_path), "the current folder"),
                          (str(ckpt), "the checkpoint folder"), (str(model), "the --model folder"),
                          (str(tmp_path / "models"), "the --model folder"), (str(out), "the output folder"),
                          (str(tmp_path / "runs"), "the output folder"), (str(data.parent), "the data set"),
                          (str(REPO / "examples" / "chat-tokenizer"), "the tokenizer")]:
        cfg = load_config(None, {"save_hf": save_hf, "checkpoint_dir": str(ckpt), "output_dir": str(out),
                                 "overwrite": "true", "dataset": str(data),
                                 "tokenizer": str(REPO / "examples" / "chat-tokenizer")})
        with pytest.raises(UserError, match=f"would write into {what}"):
            check_outputs(cfg, model)


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


def test_an_output_folder_holding_a_run_is_kept(tmp_path):
    out = tmp_path / "out"
    assert run_cli([*SHORT, "--output-dir", str(out)]).returncode == 0
    before = (out / "results.json").read_bytes()
    refused(run_cli([*SHORT, "--output-dir", str(out), "--lr", "1e-3"]), "already holds a run's results.json")
    assert (out / "results.json").read_bytes() == before
    assert run_cli([*SHORT, "--output-dir", str(out), "--lr", "1e-3", "--overwrite"]).returncode == 0
    assert (out / "results.json").read_bytes() != before


def test_every_file_a_run_writes_into_its_output_folder_is_kept(tmp_path):
    for plots in ("true", "false"):
        cfg = load_config(None, {"output_dir": str(tmp_path), "plots": plots})
        assert ("loss.png" in output_files(cfg)) == (plots == "true")
        for name in output_files(cfg):  # a hand-written config.yaml, a plot of the user's...
            (tmp_path / name).write_text("mine")
            with pytest.raises(UserError, match=name):
                check_outputs(cfg, None)
            cfg.overwrite = True
            check_outputs(cfg, None)
            cfg.overwrite = False
            (tmp_path / name).unlink()
        (tmp_path / "loss.png").write_text("mine")  # a file the run will not write is no concern of it
        if plots == "false":
            check_outputs(cfg, None)


def test_the_runs_own_inputs_are_never_replaced_even_with_overwrite(tmp_path):
    config = tmp_path / "config.yaml"
    save_config(load_config(None, {"steps": "2"}), config)
    before = config.read_text()
    refused(run_cli(["--config", str(config), "--output-dir", str(tmp_path), "--overwrite"]),
            f"would replace the --config file ({config})")
    assert config.read_text() == before
    (tmp_path / "results.json").write_text('{"losses": [1.0, 1.0]}')
    # Read again by a resume or a restart of the run, which must meet the same reference and placement.
    for key, what in (("loss_check", "the loss-check reference"), ("ep_placement", "the ep_placement load")):
        cfg = load_config(None, {"output_dir": str(tmp_path), key: str(tmp_path / "results.json"),
                                 "overwrite": "true", "ep_size": "2"}, world_size=2)
        with pytest.raises(UserError, match=f"would replace {what}"):
            check_outputs(cfg, None)


@pytest.mark.parametrize("key", ["--output-dir", "--checkpoint-dir", "--save-hf"])
def test_an_empty_path_is_refused(key, tmp_path):
    proc = run_cli([key, "", *([] if key == "--output-dir" else ["--output-dir", str(tmp_path)])])
    assert proc.returncode == ExitCode.BAD_INPUT
    assert_one_line_error(proc, f"{key[2:].replace('-', '_')} is an empty path")


def test_a_free_space_refusal_shows_the_difference_between_the_sizes(tmp_path, monkeypatch):
    assert [size_text(n) for n in (512, 15.8e6, 8e6, 3 * 2**30, 2**50)] == [
        "512 B", "15.1 MiB", "7.63 MiB", "3 GiB", "1.02e+03 TiB"]
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: SimpleNamespace(free=8_000_000))
    with pytest.raises(UserError, match=r"needs about 15.1 MiB, 7.63 MiB free"):
        require_free_space(tmp_path, 15_800_000, "the export")


@pytest.mark.parametrize("ranks", ["-1", "0", "two"])
def test_estimate_memory_refuses_what_is_no_number_of_ranks(ranks):
    proc = run_cli(["--estimate-memory", ranks])
    assert proc.returncode == ExitCode.BAD_INPUT
    assert_one_line_error(proc, f"--estimate-memory takes a number of ranks (1 or more), got {ranks}")


# Holds the folders it is given as a run would (the last, an export's, from beside it), until it is killed.
HOLD = """import sys, time
from pathlib import Path
from te_mixtral.folder_lock import FolderLocks
locks = FolderLocks()
*folders, export = sys.argv[1:]
for folder in folders:
    locks.claim(Path(folder), "a folder")
locks.claim(Path(export), "an export folder", beside=True)
print("held", flush=True)
time.sleep(300)
"""


def test_a_folder_in_use_by_another_run_is_refused_naming_it_until_that_run_dies(tmp_path, lora_base):
    out, ckpt, export = tmp_path / "out", tmp_path / "ckpt", tmp_path / "export"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out), str(ckpt), str(export)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        # --overwrite and --resume allow replacing another run's files, never while it writes them.
        refused(run_cli([*SHORT, "--output-dir", str(out), "--overwrite"]),
                f"output_dir {out} is in use by another run (pid {holder.pid} on {socket.gethostname()}, started")
        refused(run_cli([*SHORT, "--output-dir", str(tmp_path / "b"), "--checkpoint-dir", str(ckpt), "--overwrite"]),
                f"checkpoint_dir {ckpt} is in use by another run (pid {holder.pid}")
        for key, lora in (("--save-hf", []), ("--save-adapter", lora_base)):  # exported to at once
            refused(run_cli([*SHORT, "--output-dir", str(tmp_path / key), key, str(export), *lora]),
                    f"{key[2:].replace('-', '_')} {export} is in use by another run (pid {holder.pid}")
    finally:
        holder.kill()  # no cleanup, as the OOM killer would: the operating system releases the lock
        holder.wait()
    stale = [out / LOCK_FILE, ckpt / LOCK_FILE, lock_path(export, beside=True)]
    assert all(path.is_file() for path in stale)  # a killed run's lock files stay, locked by no one
    proc = run_cli([*SHORT, "--output-dir", str(out), "--checkpoint-dir", str(ckpt), "--overwrite",
                    "--save-hf", str(export)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert not any(path.exists() for path in stale)  # a run that ends deletes its lock files as it releases them
    with FolderLocks() as locks:  # and a run releases its own when it ends
        locks.claim(out, "output_dir")
        locks.claim(ckpt, "checkpoint_dir")


def test_a_lock_file_deleted_as_another_run_locks_it_is_locked_anew(tmp_path, monkeypatch):
    # The race a lock file deleted on release opens: a second run opens the file, the first
    # deletes it and releases it, the second locks the deleted file, and a third run would lock
    # a new one beside it. The second must see that its file is gone and lock the new one.
    import fcntl

    first, second = FolderLocks(), FolderLocks()
    first.claim(tmp_path, "output_dir")
    flock = fcntl.flock

    def first_releases_meanwhile(file, operation):  # the second has opened the file: now the first ends
        monkeypatch.setattr(fcntl, "flock", flock)
        first.close()
        return flock(file, operation)

    monkeypatch.setattr(fcntl, "flock", first_releases_meanwhile)
    with second:
        second.claim(tmp_path, "output_dir")
        assert f"pid {os.getpid()}" in (tmp_path / LOCK_FILE).read_text()
        with pytest.raises(UserError, match=f"output_dir {tmp_path} is in use by another run"):
            FolderLocks().claim(tmp_path, "output_dir")
    assert not (tmp_path / LOCK_FILE).exists()


@pytest.mark.parametrize("beside", [False, True])
def test_a_lock_file_that_cannot_be_opened_is_one_line_naming_it(tmp_path, beside):
    # A folder where the lock file goes (running as root, permissions would not stop us; this
    # does): before, open's IsADirectoryError was a traceback.
    folder = tmp_path / "export"
    lock_path(folder, beside).mkdir(parents=True)
    with pytest.raises(UserError) as refused, FolderLocks() as locks:
        locks.claim(folder, "save_hf", beside)
    assert str(refused.value) == (f"cannot lock save_hf {folder} against a second run: its lock file "
                                  f"{lock_path(folder, beside)} cannot be opened: Is a directory")


def test_one_folder_for_the_output_and_the_checkpoints_is_the_runs_own(tmp_path):
    # As HF Trainer keeps its checkpoints in its output folder. The run holds the folder's
    # lock once: a second claim of its own is no "other run" (one named by this run's pid).
    run = tmp_path / "run"
    proc = run_cli([*SHORT, "--output-dir", str(run), "--checkpoint-dir", str(run)])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (run / "results.json").is_file() and (run / "latest").read_text().strip() == "step-000002"


def test_resuming_into_another_runs_log_is_refused(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    (ckpt / "step-000002").mkdir(parents=True)
    (ckpt / "latest").write_text("step-000002\n")
    (ckpt / "step-000002" / "meta.json").write_text(json.dumps({"losses": [4.5, 4.25]}))
    out.mkdir()

    def log(*losses):
        lines = [json.dumps({"step": step, "loss": loss}) for step, loss in enumerate(losses, 1)]
        (out / "steps.jsonl").write_text("\n".join([*lines, '{"step": 9, "lo']) + "\n")

    for overwrite in ("false", "true"):  # a resume keeps the log's earlier lines either way
        cfg = load_config(None, {"output_dir": str(out), "checkpoint_dir": str(ckpt), "resume": "true",
                                 "overwrite": overwrite})
        log(4.5, 4.0, 3.5)  # another run's, or this run's continued elsewhere from step 1
        with pytest.raises(UserError, match="is the log of another run than checkpoint .*step 2: loss 4.0 there, "
                                            "4.25 in the checkpoint"):
            check_outputs(cfg, None)
        log(4.5, 4.25, 3.5)  # the checkpoint's own run, which went on past it before it stopped
        check_outputs(cfg, None)


def test_a_log_is_the_checkpoints_run_only_if_it_carries_the_checkpoints_run_id(tmp_path):
    # Two runs of one seed and data log the same first loss: only the run id tells them apart.
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    (ckpt / "step-000001").mkdir(parents=True)
    (ckpt / "latest").write_text("step-000001\n")
    (ckpt / "step-000001" / "meta.json").write_text(json.dumps({"losses": [4.5], "run_id": "a" * 32}))
    out.mkdir()
    cfg = load_config(None, {"output_dir": str(out), "checkpoint_dir": str(ckpt), "resume": "true"})
    for run_id, refused_ in (("b" * 32, True), ("a" * 32, False)):
        (out / "steps.jsonl").write_text(json.dumps({"run_id": run_id, "step": 1, "loss": 4.5}) + "\n")
        if refused_:
            with pytest.raises(UserError, match=r"is the log of another run .*\(its run id bbbbbbbbbbbb"):
                check_outputs(cfg, None)
        else:
            check_outputs(cfg, None)


def test_a_run_writes_its_id_into_its_log_and_its_checkpoints(tmp_path):
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = run_cli([*SHORT, "--output-dir", str(out), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    ids = {json.loads(line)["run_id"] for line in (out / "steps.jsonl").read_text().splitlines()}
    saved = {json.loads((folder / "meta.json").read_text())["run_id"] for folder in ckpt.glob("step-*")}
    assert len(ids) == 1 and ids == saved


@pytest.mark.parametrize("key, earlier, theirs", [("save_adapter", "save_hf", "model.safetensors.index.json"),
                                                  ("save_hf", "save_adapter", "adapter_config.json")])
def test_an_export_never_replaces_an_earlier_export_of_the_other_kind(tmp_path, key, earlier, theirs):
    """An adapter export into a folder holding a whole model's export (or the reverse) would
    delete the other's files: only an export of the same kind is replaced unasked."""
    folder = tmp_path / "export"
    folder.mkdir()
    (folder / EXPORT_MARKER).write_text(json.dumps({"written_by": "te_mixtral"}))
    (folder / theirs).write_text("{}")
    settings = {key: str(folder), "output_dir": str(tmp_path / "out"), **LORA}
    with pytest.raises(UserError, match=f"{key} {folder} holds an earlier {earlier} export \\({theirs}\\), which "
                                        f"this export would replace"):
        check_outputs(load_config(None, settings), None)
    check_outputs(load_config(None, {**settings, "overwrite": "true"}), None)
    (folder / theirs).unlink()  # an earlier export of its own kind, but another run's (it names none)
    with pytest.raises(UserError, match=f"{key} {folder} holds the export of another run"):
        check_outputs(load_config(None, settings), None)


def test_an_export_of_another_run_is_replaced_only_with_overwrite(tmp_path):
    """An export is the run's result, as its results.json is: a run (a resume of its own
    included) replaces its own export unasked, another run's only with --overwrite. A resume of
    a run whose export folder another run has since exported into is another run there too."""
    export, ckpt = tmp_path / "export", tmp_path / "ckpt"

    def run(name, *more):
        return run_cli([*SHORT, "--save-hf", str(export), "--checkpoint-dir", str(ckpt), "--output-dir",
                        str(tmp_path / name), *more])

    def exported():
        return {p.name: p.read_bytes() for p in export.iterdir()}

    proc = run("a")
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run("a-resumed", "--resume", "--steps", "3")  # the same run, further: its own export
    assert proc.returncode == 0, proc.stderr[-2000:]
    before = exported()
    refused(run("b", "--checkpoint-dir", str(tmp_path / "ckpt-b")), f"save_hf {export} holds the export of another "
            f"run, which this export would replace; choose another folder, or pass --overwrite to replace it")
    assert exported() == before
    proc = run("b", "--checkpoint-dir", str(tmp_path / "ckpt-b"), "--overwrite", "--seed", "7")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert exported() != before
    before = exported()
    refused(run("a-again", "--resume", "--steps", "4"), f"save_hf {export} holds the export of another run")
    assert exported() == before


@pytest.mark.parametrize("key", ["--save-hf", "--save-adapter"])
def test_an_export_folder_that_is_a_link_to_another_disk_is_written_there(tmp_path, key, lora_base):
    """An export is staged beside the folder it lands in (`DIR.tmp`, `DIR.old`), which a link
    names elsewhere: staged beside the link, on another filesystem than its target, its files
    could not be renamed into it (EXDEV), and the trained model was left in a scratch folder the
    next export deletes."""
    disk = Path("/dev/shm")
    if not disk.is_dir() or os.stat(disk).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a filesystem of its own")
    target = Path(tempfile.mkdtemp(dir=disk)) / "finetuned"
    try:
        target.mkdir()
        (tmp_path / "finetuned").symlink_to(target)
        proc = run_cli([*SHORT, *lora_base, key, str(tmp_path / "finetuned"), "--output-dir", str(tmp_path / "out")])
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert (target / EXPORT_MARKER).is_file()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["finetuned", "out"]  # nothing staged beside the link
        assert sorted(p.name for p in target.parent.iterdir()) == ["finetuned"]  # nor left beside the folder
    finally:
        shutil.rmtree(target.parent)
