"""Runs killed (SIGKILL, as the OOM killer kills) at a point of their writing, and disks that
fill while a run writes: what was there before stays whole, nothing half written is taken for
a good file or left in the next run's way, a resume goes on exactly as if nothing had
happened, and a full disk is one line.

Every run here is one of tests/workers/die_at.py's: one command, started with the session,
whose runs each kill themselves at a chosen call (or find every later write refused, as on
a full disk); nothing in the app is mocked. Each test reads what its runs left.
"""

import json
import sys
from types import SimpleNamespace

from background import Command
from launch import RUN_DIR, assert_one_line_error, run_cli

from te_mixtral.errors import ExitCode
from te_mixtral.training.outputs import EXPORT_MARKER

SHORT = ["--seq_len", "64", "--timing_warmup_steps", "1"]
CKPT = [*SHORT, "--steps", "6", "--checkpoint-every", "2", "--checkpoint_keep", "3"]
EXPORT = [*SHORT, "--steps", "2", "--save-hf", f"{RUN_DIR}/hf"]
REEXPORT = [*EXPORT, "--overwrite"]  # into the export of an earlier run
OTHER_EXPORT = [*REEXPORT, "--lr", "1e-2"]  # other weights
CHAT = ["--config", "configs/tiny-chat.yaml", "--steps", "1", "--timing_warmup_steps", "0"]
MARKER = "*.te_mixtral_scratch"  # files.SCRATCH_MARKER, as a die_at pattern
RUNS = [
    # A checkpoint save killed while DCP writes its data, then the resume killed while its first
    # save clears what that left, then resumed again.
    {"name": "whole", "argv": [*CKPT, "--checkpoint-dir", f"{RUN_DIR}/whole/ckpt", "--output-dir",
                               f"{RUN_DIR}/whole/out"]},
    {"name": "killed_saving", "argv": [*CKPT, "--checkpoint-dir", f"{RUN_DIR}/ckpt", "--output-dir", f"{RUN_DIR}/out"],
     "die": {"die": ["open", "*/step-000004.tmp/__0_0.distcp", 1], "mid_file": 100_000}},
    {"name": "killed_clearing", "argv": [*CKPT, "--checkpoint-dir", f"{RUN_DIR}/ckpt", "--output-dir",
                                         f"{RUN_DIR}/out", "--resume"],
     "die": {"arm": ["os.remove", MARKER], "die": ["os.remove|os.rmdir", "*", 1]}},
    {"name": "resumed", "argv": [*CKPT, "--checkpoint-dir", f"{RUN_DIR}/ckpt", "--output-dir", f"{RUN_DIR}/out",
                                 "--resume"]},
    # An export killed as it makes the folder the export it replaces moves to, then exported again.
    {"name": "exported", "argv": [*EXPORT, "--output-dir", f"{RUN_DIR}/e1"]},
    {"name": "killed_exporting", "argv": [*REEXPORT, "--output-dir", f"{RUN_DIR}/e2"],
     "die": {"die": ["open", "*/hf.old/.te_mixtral_scratch", 1]}},
    {"name": "exported_again", "argv": [*REEXPORT, "--output-dir", f"{RUN_DIR}/e3"]},
    # Another export into it (another learning rate: other weights) killed as the earlier export's
    # files move out, the next killed as the new files move in, then one that finishes.
    {"name": "killed_moving_out", "argv": [*OTHER_EXPORT, "--output-dir", f"{RUN_DIR}/e4"],
     "die": {"die": ["os.rename", "*/hf/*", 3]}},
    {"name": "killed_moving_in", "argv": [*OTHER_EXPORT, "--output-dir", f"{RUN_DIR}/e5"],
     "die": {"die": ["os.rename", "*/hf.tmp/*", 3]}},
    {"name": "exported_at_last", "argv": [*OTHER_EXPORT, "--output-dir", f"{RUN_DIR}/e6"]},
    # Killed in the middle of drawing its loss plot.
    {"name": "killed_drawing", "argv": [*SHORT, "--steps", "2", "--output-dir", f"{RUN_DIR}/drawn"],
     "die": {"die": ["open", "*loss.png*", 1], "mid_file": 2000}},
    # The disk full from TensorBoard's first event on.
    {"name": "tensorboard_full", "argv": [*SHORT, "--steps", "3", "--report_to", "tensorboard", "--output-dir",
                                          f"{RUN_DIR}/tb"],
     "die": {"die": ["open", "*/events.out.tfevents*", 2], "full": 0}},
    # The disk full under `datasets`' cache (HF_DATASETS_CACHE, below), from its first write of
    # a data file's records, and from its first map over them.
    {"name": "datasets_full_reading", "argv": [*CHAT, "--output-dir", f"{RUN_DIR}/d1", "--dataset",
                                               "examples/chat-sharegpt.jsonl"],
     "die": {"die": ["open", "*/datasets/*", 1], "full": 0}},
    {"name": "datasets_full_mapping", "argv": [*CHAT, "--output-dir", f"{RUN_DIR}/d2"],
     "die": {"die": ["open", "*/datasets/*/tmp*", 1], "full": 0}},
    # Killed after its last step, before its results.json (and before any checkpoint).
    {"name": "killed_unsaved", "argv": [*SHORT, "--steps", "2", "--output-dir", f"{RUN_DIR}/unsaved"],
     "die": {"die": ["open", "*/.results.json.*", 1]}},
]
DIE_AT = Command((sys.executable, "tests/workers/die_at.py", RUN_DIR, json.dumps(RUNS)),
                 (("OMP_NUM_THREADS", "1"), ("HF_DATASETS_CACHE", f"{RUN_DIR}/datasets")), timeout=300)
PLANNED_COMMANDS = [DIE_AT]  # run from the session's start (conftest.py's planned_command)


def runs(planned_command):
    """{name: what die_at.py recorded of the run} and the folder they wrote into."""
    proc, folder = planned_command(DIE_AT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {run["name"]: json.loads((folder / "runs" / f"{run['name']}.json").read_text()) for run in RUNS}, folder


def died(run: dict, *events: str) -> None:
    """The run was killed (SIGKILL, or SIGXFSZ in the middle of a file) at one of `events`."""
    assert run["status"] in (-9, -25), run["stderr"][-2000:]
    assert run["died_at"][0] in events, run["died_at"]


def test_a_resume_after_kills_in_a_save_and_in_its_clearing_goes_on_exactly(planned_command):
    # The second kill left step-000004.tmp empty (or without its marker): before, the third run
    # was refused ('step-000004.tmp is in the way ... nothing shows te_mixtral wrote it').
    ran, folder = runs(planned_command)
    whole, killed, clearing, resumed = (ran[name] for name in ("whole", "killed_saving", "killed_clearing", "resumed"))
    assert whole["status"] == 0, whole["stderr"][-2000:]
    died(killed, "open")
    # The checkpoints before the kill are those of the run never killed, byte for byte.
    data = ("__0_0.distcp", "rank00000.pt")
    assert {f"ckpt/{s}/{f}": whole["files"][f"whole/ckpt/{s}/{f}"] for s in ("step-000002",) for f in data} == {
        k: v for k, v in killed["files"].items() if k.startswith("ckpt/step-000002/") and k.endswith(data)}
    assert not any(k.startswith("ckpt/step-000004/") for k in killed["files"])
    died(clearing, "os.remove", "os.rmdir")
    assert resumed["status"] == 0, resumed["stderr"][-2000:]
    assert "resuming from" in resumed["stdout"] and "step 2 of 6" in resumed["stdout"]
    results = [json.loads((folder / out / "results.json").read_text()) for out in ("whole/out", "out")]
    assert results[0]["losses"] == results[1]["losses"]
    last = "step-000006"
    assert {f: whole["files"][f"whole/ckpt/{last}/{f}"] for f in data} == {
        f: resumed["files"][f"ckpt/{last}/{f}"] for f in data}


def test_an_export_killed_as_it_replaces_an_earlier_one_keeps_it_and_exports_again(planned_command):
    # The kill left hf.old empty: before, the next run was refused ('hf.old is in the way').
    ran, _ = runs(planned_command)
    exported, killed, again = ran["exported"], ran["killed_exporting"], ran["exported_again"]
    assert exported["status"] == 0, exported["stderr"][-2000:]
    died(killed, "open")

    def export(run):
        return {k: v for k, v in run["files"].items() if k.startswith("hf/") and not k.endswith(".lock")}

    assert export(killed) == export(exported)  # the earlier export, whole
    assert again["status"] == 0, again["stderr"][-2000:]
    ours = f"hf/{EXPORT_MARKER}"  # names the run that wrote it
    assert {**export(again), ours: None} == {**export(exported), ours: None}  # the same weights: the same bytes
    assert not any(k.startswith(("hf.tmp/", "hf.old/")) for k in again["files"])


def test_exports_killed_as_files_move_out_and_in_leave_the_earlier_whole_and_the_next_finishes(planned_command):
    # Before: the second export deleted hf.old, the killed first's half of the earlier export with
    # its te_mixtral_export.json, and once killed too, the next was refused ('holds
    # model-00002-of-00003.safetensors, tokenizer.json, which the export would replace, and no
    # earlier te_mixtral export').
    ran, _ = runs(planned_command)
    earlier = {k: v for k, v in ran["exported_again"]["files"].items() if k.startswith("hf/") and ".lock" not in k}
    died(ran["killed_moving_out"], "os.rename")
    died(ran["killed_moving_in"], "os.rename")
    kept = {k.replace("hf.old/", "hf/"): v for k, v in ran["killed_moving_in"]["files"].items()
            if k.startswith("hf.old/") and not k.endswith("scratch")}
    assert kept == earlier  # whole, as the new files came in
    last = ran["exported_at_last"]
    assert last["status"] == 0, last["stderr"][-2000:]
    export = {k: v for k, v in last["files"].items() if k.startswith("hf") and ".lock" not in k}
    assert sorted(export) == sorted(earlier)  # the new export, whole, and nothing left beside it
    assert export["hf/model-00001-of-00003.safetensors"] != earlier["hf/model-00001-of-00003.safetensors"]


def test_a_run_killed_as_it_draws_leaves_no_half_picture(planned_command):
    ran, folder = runs(planned_command)
    died(ran["killed_drawing"], "open")
    assert json.loads((folder / "drawn" / "results.json").read_text())["losses"]  # written before
    plot = folder / "drawn" / "loss.png"
    # A PNG ends with its IEND chunk; before, the first 2000 bytes of one stood as loss.png.
    assert not plot.exists() or plot.read_bytes().endswith(b"IEND\xaeB`\x82")


def test_a_disk_that_fills_under_tensorboard_is_one_line_after_the_last_step(planned_command):
    # As steps.jsonl: the events stop, training goes on, the run ends saying what it could not
    # write. Before: a traceback from TensorBoard's writer thread at the first step, exit 1; then
    # the one line, and still that thread's own traceback beside it.
    ran, folder = runs(planned_command)
    run = ran["tensorboard_full"]
    assert run["status"] == ExitCode.WRITE_FAILED, run["stderr"][-3000:]
    assert "Traceback" not in run["stderr"], run["stderr"][-3000:]
    assert_one_line_error(SimpleNamespace(returncode=run["status"], stderr=run["stderr"]),
                          f"cannot write report_to tensorboard in {folder / 'tb'}: File too large (its steps stop")
    printed = next(x for x in run["stdout"].splitlines() if x.startswith("results.json (not saved): "))
    assert len(json.loads(printed.removeprefix("results.json (not saved): "))["losses"]) == 3


def test_a_disk_that_fills_under_the_datasets_cache_is_one_line_naming_it(planned_command):
    # Before: 'cannot read examples/chat-sharegpt.jsonl: [Errno 27] File too large' (the data
    # file blamed), and a traceback ending in 'I/O operation on closed file' from a map.
    ran, folder = runs(planned_command)
    for name in ("datasets_full_reading", "datasets_full_mapping"):
        run = ran[name]
        assert run["status"] == ExitCode.WRITE_FAILED, (name, run["stderr"][-3000:])
        assert_one_line_error(SimpleNamespace(returncode=run["status"], stderr=run["stderr"]),
                              f"cannot write the datasets cache {folder / 'datasets'}: File too large")


def test_a_run_killed_before_its_first_checkpoint_is_not_said_to_resume(planned_command, tmp_path):
    # Its steps.jsonl stays (the log of a run that did not finish). Before, the next run was
    # told to 'pass --resume to continue it', which then failed: there was nothing to resume.
    ran, folder = runs(planned_command)
    died(ran["killed_unsaved"], "open")
    out = folder / "unsaved"
    assert (out / "steps.jsonl").is_file() and not (out / "results.json").exists()
    again = [*SHORT, "--steps", "2", "--output-dir", str(out)]
    for extra, why in [([], "this run names no checkpoint_dir"),
                       (["--checkpoint-dir", str(tmp_path)], f"checkpoint_dir {tmp_path} holds no checkpoint")]:
        proc = run_cli([*again, *extra])
        line = assert_one_line_error(proc, f"output_dir {out} holds the steps.jsonl of a run that did not finish",
                                     why, "--overwrite")[0]
        assert "pass --resume" not in line
    assert run_cli([*again, "--overwrite"]).returncode == 0
