"""Faults: a rank killed mid-run stops the whole job quickly and leaves a checkpoint that
resumes; a directory that cannot be written is refused before training, on every rank."""

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from background import Command
from conftest import REPO
from launch import RUN_DIR, app_command, assert_one_line_error, run_cli

import te_mixtral.training.checkpoint as checkpoint
from te_mixtral.distributed.layout import Layout
from te_mixtral.errors import ExitCode, UserError
from te_mixtral.folder_lock import LOCK_FILE, FolderLocks
from te_mixtral.training.hf_checkpoint import check_export_space

DIST_TIMEOUT_S = 30
SMALL = ["--timing_warmup_steps", "1", "--batch_size", "4", "--seq_len", "64", "--ep-size", "2"]


def worker_pids(launcher_pid: int) -> dict[int, int]:
    """{rank: pid} of the processes torchrun started, found through /proc (Linux)."""
    ranks = {}
    for proc in Path("/proc").iterdir():
        try:
            parent = int((proc / "stat").read_text().rpartition(")")[2].split()[1])
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # not a process, or one that just ended
        rank = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
        if parent == launcher_pid and rank:
            ranks[int(rank[0])] = int(proc.name)
    return ranks


def latest_step(ckpt: Path) -> int:
    try:
        return int((ckpt / "latest").read_text().strip().removeprefix("step-"))
    except (OSError, ValueError):
        return 0


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the ranks through /proc")
def test_a_killed_rank_stops_the_job_and_the_last_checkpoint_resumes(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    args = [*SMALL, "--steps", "1000", "--checkpoint-every", "1", "--checkpoint-dir", str(ckpt),
            "--dist-timeout-s", str(DIST_TIMEOUT_S), "--log_every", "1000", "--output-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2", str(REPO / "run_finetune_ep.py"), *args],
                                    cwd=REPO, env=env, stdout=stdout, stderr=stderr)
        try:
            deadline = time.monotonic() + 240
            while latest_step(ckpt) < 2 and launcher.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert latest_step(ckpt) >= 2, (tmp_path / "stderr").read_text()[-3000:]
            # No cleanup, no exception, no message from the victim: like the OOM killer. With a
            # checkpoint every step, the kill often lands in the middle of a save.
            os.kill(worker_pids(launcher.pid)[1], signal.SIGKILL)
            killed = time.monotonic()
            launcher.wait(timeout=DIST_TIMEOUT_S + 30)
            stopped_after = time.monotonic() - killed
        finally:
            if launcher.poll() is None:
                launcher.kill()
    errors = (tmp_path / "stderr").read_text()
    assert launcher.returncode != 0
    assert stopped_after < DIST_TIMEOUT_S, f"the job took {stopped_after:.0f} s to stop"
    assert "Signal 9 (SIGKILL)" in errors  # torchrun names the rank that died, and how
    assert not (out / "results.json").exists()

    # The checkpoint `latest` names is whole: it verifies, loads and trains on. On one rank, in
    # this process, which reads both ranks' files (a resume on another layout, as
    # tests/training/test_resume_reshard.py checks against a run never stopped).
    done = latest_step(ckpt)
    proc = run_cli([*SMALL, "--ep-size", "1", "--steps", str(done + 2), "--checkpoint-dir", str(ckpt), "--resume",
                    "--log_every", "1", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"(step {done} of {done + 2}), written by 2 rank(s), read by 1" in proc.stdout
    assert f"train.steps 1000 -> {done + 2}" in proc.stdout  # the changed schedule is pointed out
    assert latest_step(ckpt) == done + 2
    assert not list(ckpt.glob("*.tmp")), "the interrupted save's leftovers were not cleared"


def ended(pid: int) -> bool:
    """Whether process `pid` is gone, or a zombie waiting for a reaper that does not reap it:
    each of its threads (its first shows Z while the others still end, its files still open)."""
    def thread_ended(task: Path) -> bool:
        try:
            return (task / "stat").read_text().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            return True  # went as it was read

    try:
        return all(map(thread_ended, Path(f"/proc/{pid}/task").iterdir()))
    except OSError:
        return True  # gone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a parent-death signal is Linux's (prctl)")
def test_the_ranks_end_with_their_launcher_and_free_the_folders(tmp_path):
    # torchrun starts each rank in a session of its own, so a SIGKILL of its process group (the
    # agent's: what `kill -9 -- -PGID` of a job started by setsid, or a batch system, sends)
    # misses them. Before, the ranks trained on with no launcher, holding the output folder's
    # lock, and the next run there was refused as "in use by another run".
    out = tmp_path / "out"
    launcher = subprocess.Popen(app_command([*SMALL, "--steps", "5000", "--log_every", "1000", "--plots", "false",
                                             "--output-dir", str(out)], nproc=2),
                                cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
    ranks = {}
    try:
        deadline = time.monotonic() + 120
        while not (out / LOCK_FILE).is_file() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 0 holds the folder: both ranks run
        ranks = worker_pids(launcher.pid)
        assert len(ranks) == 2, launcher.stderr.read()[-3000:] if launcher.poll() is not None else ranks
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 5
        while not all(map(ended, ranks.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(map(ended, ranks.values())), f"ranks still running 5 s after their launcher died: {ranks}"
    finally:
        for pid in ranks.values():
            if not ended(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    with FolderLocks() as locks:  # the folder is free again: the next run is not refused
        locks.claim(out, "output_dir")


# torchrun --max-restarts 1 (ours: torchrun's own shares one rendezvous store across attempts, and
# a restart may then fail to connect; te_mixtral/torchrun.py), whose rank 1 is killed right after
# the step-2 checkpoint of the first attempt.
RESTARTED = Command((sys.executable, "-m", "te_mixtral.torchrun", "--standalone", "--nproc_per_node=2",
                     "--max-restarts", "1", str(REPO / "tests/workers/killed_after_checkpoint.py"), "2", *SMALL,
                     "--steps", "3", "--plots", "false", "--checkpoint-every", "1", "--checkpoint-dir", f"{RUN_DIR}/ckpt",
                     "--output-dir", f"{RUN_DIR}/out", "--dist-timeout-s", str(DIST_TIMEOUT_S), "--log_every", "1"),
                    (("OMP_NUM_THREADS", "1"),), timeout=240)
# 4 ranks (EP=2 x DP=2), whose EP and replica groups are not the world; rank 3 silent, the others
# giving up on it after SILENT_TIMEOUT_S.
SILENT_TIMEOUT_S = 3
SILENT_RANK = Command(tuple(app_command([RUN_DIR, str(SILENT_TIMEOUT_S)], 4, "tests/workers/silent_peer.py")),
                      (("OMP_NUM_THREADS", "1"),), timeout=120)
# A file where the checkpoint folder's parent should be (running as root, permissions would not stop
# us; this does): the repository's README, in which nothing can be made.
BLOCKER = REPO / "README.md"
UNWRITABLE_CHECKPOINT_DIR = Command(tuple(app_command([*SMALL, "--steps", "4", "--checkpoint-dir",
                                                    str(BLOCKER / "ckpt"), "--output-dir", f"{RUN_DIR}/out"], 2)),
                                    (("OMP_NUM_THREADS", "1"),), timeout=120)
# run from the session's start (conftest.py's planned_command)
PLANNED_COMMANDS = [RESTARTED, SILENT_RANK, UNWRITABLE_CHECKPOINT_DIR]


def test_a_job_torchrun_restarts_continues_from_its_last_checkpoint(planned_command):
    # Before, the restart was refused: the first attempt's steps.jsonl was in its way, and the
    # line said to pass --resume (which the restart, run with the same command line, could not).
    proc, folder = planned_command(RESTARTED)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # Rank 0's line as its peer died, where it came before torchrun stopped it: the restart, no --resume.
    for line in (line for line in proc.stderr.splitlines() if "a collective failed" in line):
        assert "torchrun restarts the job (restart 1 of 1), which continues from " in line and "--resume" not in line
    notes = [line for line in proc.stdout.splitlines() if "torchrun restarted the job" in line]
    assert notes == [f"te_mixtral: torchrun restarted the job (restart 1 of 1): it continues from "
                     f"{folder / 'ckpt' / 'step-000002'}, as --resume does"], proc.stdout
    # One run in one log: the first attempt's two steps, then the restart's one, under one run id,
    # and results.json tells the whole run (the folder lock let the restart in: its holder was dead).
    lines = [json.loads(line) for line in (folder / "out" / "steps.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3] and len({line["run_id"] for line in lines}) == 1
    assert json.loads((folder / "out" / "results.json").read_text())["losses"] == [line["loss"] for line in steps]


@pytest.mark.parametrize("restart, advice", [
    # Before, the first attempt said "resume from the last checkpoint with --resume", as torchrun restarted it.
    ("0", "torchrun restarts the job (restart 1 of 2), which continues from this launch's newest checkpoint, if it "
          "wrote one"),
    ("2", "resume from the last checkpoint with --resume"),  # the restarts spent: the user's turn
])
def test_the_lost_peer_line_says_what_follows_under_torchruns_restarts(tmp_path, monkeypatch, restart, advice):
    # In this process, with the environment torchrun gives the processes it starts, and a
    # collective that fails as gloo's do when a peer dies.
    import te_mixtral.training.loop as loop

    def peer_died(*args):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

    monkeypatch.setattr(loop, "train", peer_died)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    proc = run_cli(["--steps", "2", "--seq_len", "32", "--checkpoint-dir", str(tmp_path / "ckpt"),
                    "--output-dir", str(tmp_path / "out")])
    assert proc.returncode == ExitCode.LOST_A_PEER
    [line] = assert_one_line_error(proc, "a collective failed, another rank probably died or hung (see its log); "
                                         f"{advice} ([")
    assert ("--resume" in line) == (restart == "2")


@pytest.mark.parametrize("written_under, restarted_under, why", [
    # Before, this restart said there was "none in {ckpt} yet", beside the earlier job's checkpoint.
    ("an-earlier-job", "this-job", "the newest in {ckpt}, step-000002, is another job's"),
    # torchrun's id without --rdzv-id (outside --standalone) is the same for every job.
    ("none", "none", "torchrun's --rdzv-id was not given, so its checkpoints cannot be told from another job's"),
])
def test_a_restart_never_continues_another_launchs_checkpoint(tmp_path, monkeypatch, written_under, restarted_under,
                                                               why):
    # In this process, with the environment torchrun gives the processes it starts: first a
    # job's, which leaves a checkpoint; then a restart of another launch, whose first attempt
    # died before its first checkpoint, with the same folders (the first attempt refused them).
    ckpt, args = tmp_path / "ckpt", ["--steps", "2", "--seq_len", "32", "--checkpoint-every", "1", "--plots", "false"]
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", written_under)
    assert run_cli([*args, "--checkpoint-dir", str(ckpt), "--output-dir", str(tmp_path / "out")]).returncode == 0
    before = {p: p.stat().st_mtime_ns for p in ckpt.rglob("step-*/*")}
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", restarted_under)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    proc = run_cli([*args, "--checkpoint-dir", str(ckpt), "--output-dir", str(tmp_path / "again")])
    assert f"te_mixtral: torchrun restarted the job (restart 1 of 3), with no checkpoint of its own to continue " \
           f"from ({why.format(ckpt=ckpt)}): it runs as a new run would" in proc.stdout
    assert_one_line_error(proc, f"checkpoint_dir {ckpt} holds an earlier run's checkpoints")  # as the first attempt was
    assert {p: p.stat().st_mtime_ns for p in ckpt.rglob("step-*/*")} == before


def test_every_process_group_gives_up_on_a_silent_rank_after_dist_timeout_s(planned_command):
    """A rank stopped or stuck, not dead, says nothing: each collective waiting for it must end
    after dist_timeout_s (then the error line, exit 3), on every group the run made, not only
    the world's."""
    proc, folder = planned_command(SILENT_RANK)
    assert proc.returncode == 0, proc.stderr[-3000:]
    probed = {}
    for rank in range(3):
        for name, raised, seconds in json.loads((folder / f"rank{rank}.json").read_text()):
            assert raised and seconds < 3 * SILENT_TIMEOUT_S, (rank, name, seconds)
            probed[name] = seconds
    assert set(probed) == {"ep", "expert replicas", "reducer dense", "reducer experts"}, probed


def test_an_unwritable_checkpoint_dir_fails_every_rank_before_training(planned_command):
    proc, _ = planned_command(UNWRITABLE_CHECKPOINT_DIR)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("te_mixtral: error:")]
    assert proc.returncode != 0
    assert len(lines) == 1, proc.stderr[-3000:]  # one per job: rank 0's
    assert all(f"checkpoint_dir {BLOCKER / 'ckpt'} cannot be made: {BLOCKER} is a file, not a folder" in line
               for line in lines)
    assert "step" not in proc.stdout  # no training step ran


def test_an_unwritable_export_folder_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UserError, match="parent folder .*a_file is a file, not a folder"):
        check_export_space(model, blocker / "hf", Layout(0, 1, 1, None, None), torch.float32)


# Permission bits stop root only without CAP_DAC_OVERRIDE: as root, the app starts without it
# (setpriv takes it out of the bounding set, so the exec'd process is not given it), and the
# kernel then denies what the bits deny, as to any other user. No mock: the kernel refuses.
WITHOUT_OVERRIDE = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"] if os.geteuid() == 0 else []


def kernel_denies_writing(folder: Path) -> bool:
    """Whether a process started as the tests below start the app may not write into `folder`."""
    if WITHOUT_OVERRIDE and shutil.which("setpriv") is None:
        return False
    probe = subprocess.run([*WITHOUT_OVERRIDE, sys.executable, "-c", f"open({str(folder / 'probe')!r}, 'w')"],
                           capture_output=True)
    return probe.returncode != 0


# (the flag, which folder the kernel does not let the run write into, what the refusal says)
UNWRITABLE = [
    # Before: trained, then "cannot write the adapter export" (exit 5); the export is staged beside its folder.
    ("--save-adapter", "parent", "save_adapter {folder} is first written as adapter.tmp beside it, in {parent}, "
                                 "which is not writable"),
    pytest.param("--save-hf", "parent", "save_hf {folder} is first written as adapter.tmp beside it, in {parent}, "
                                        "which is not writable", marks=pytest.mark.slow),
    *[pytest.param(flag, "folder", f"{key} {{folder}} is not writable", marks=pytest.mark.slow) for flag, key in
      [("--save-adapter", "save_adapter"), ("--save-hf", "save_hf"), ("--output-dir", "output_dir"),
       ("--checkpoint-dir", "checkpoint_dir")]],
    pytest.param("--output-dir", "missing", "output_dir {folder} cannot be made: {parent} is not writable",
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("flag, unwritable, fragment", UNWRITABLE)
def test_a_folder_the_run_cannot_write_into_is_refused_before_training(tmp_path, flag, unwritable, fragment):
    parent, folder = tmp_path / "parent", tmp_path / "parent" / "adapter"
    folder.mkdir(parents=True)
    {"parent": parent, "folder": folder, "missing": parent}[unwritable].chmod(0o555)
    if unwritable == "missing":
        folder.rmdir()
    if not kernel_denies_writing(parent if unwritable != "folder" else folder):
        pytest.skip("permission bits do not stop this process, and setpriv cannot drop root's override here")
    # Over a hub id's base, as adapters are exported (nothing is downloaded: the folders are checked first).
    args = ["--steps", "2", "--timing_warmup_steps", "0", "--seq_len", "32", "--lora.rank", "2",
            "--model", "mistralai/Mixtral-8x7B-v0.1"]
    if flag != "--output-dir":
        args += ["--output-dir", str(tmp_path / "out")]
    proc = subprocess.run([*WITHOUT_OVERRIDE, *app_command([*args, flag, str(folder)])], cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.BAD_INPUT, proc.stderr[-2000:]
    assert_one_line_error(proc, fragment.format(folder=folder, parent=parent))
    assert "step    1/2" not in proc.stdout  # refused before training
    assert sorted(p.name for p in parent.iterdir()) == ([] if unwritable == "missing" else ["adapter"])


@pytest.mark.slow
def test_a_disk_that_fills_mid_run_keeps_what_fits_and_says_what_did_not(tmp_path):
    # RLIMIT_FSIZE makes every write past 3000 bytes of one file fail (EFBIG; Python ignores
    # SIGXFSZ), as a full disk fails them: steps.jsonl fills at its 8th line, and results.json
    # and the plots do not fit, while config.yaml does. (A run first caches the tokenizer,
    # which is larger.)
    out = tmp_path / "out"
    assert run_cli(["--steps", "1", "--seq_len", "64", "--output-dir", str(tmp_path / "warm")]).returncode == 0

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (3000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run(app_command(["--steps", "12", "--seq_len", "64", "--timing_warmup_steps", "1",
                                       "--output-dir", str(out)]),
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300, preexec_fn=limit_file_size)
    assert proc.returncode == ExitCode.WRITE_FAILED, proc.stderr[-3000:]
    line = assert_one_line_error(proc, "results.json (its content is printed above): File too large",
                                 "steps.jsonl: File too large (its lines stop before step 8)", "loss.png")[0]
    assert "config.yaml" not in line
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]  # no half line
    assert [r["step"] for r in records] == list(range(1, 8))
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["steps"] == 12
    assert not (out / "results.json").exists() and not (out / "loss.png").exists()
    printed = next(x for x in proc.stdout.splitlines() if x.startswith("results.json (not saved): "))
    assert len(json.loads(printed.removeprefix("results.json (not saved): "))["losses"]) == 12
    assert "median step" in proc.stdout  # the timing table is printed all the same


def test_a_checkpoint_that_cannot_be_written_stops_the_run_and_keeps_its_results(tmp_path, monkeypatch):
    saves = []

    def save_then_fill_the_disk(obj, f):
        if str(getattr(f, "name", "")).endswith(".pt"):  # a rank's own file (DCP's data goes through streams)
            saves.append(f.name)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        torch_save(obj, f)

    torch_save = checkpoint.torch.save
    monkeypatch.setattr(checkpoint.torch, "save", save_then_fill_the_disk)
    proc = run_cli(["--steps", "6", "--seq_len", "64", "--timing_warmup_steps", "1", "--checkpoint-every", "2",
                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--output-dir", str(tmp_path / "out")])
    assert proc.returncode == ExitCode.WRITE_FAILED
    assert_one_line_error(proc, "step-000004.tmp/rank00000.pt: No space left on device")
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(results["losses"]) == 4 and "No space left on device" in results["stopped"]
