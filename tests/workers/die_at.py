"""Not a torchrun worker: runs of `run_finetune_ep.py`, one after another, each killed where
the test says, as the OOM killer or a lost node kills: SIGKILL, no cleanup, no message.

Usage: python tests/workers/die_at.py OUT RUNS_JSON

RUNS_JSON lists the runs in order, each {"name": NAME, "argv": [app arguments], "die": SPEC}
("die" left out: a run that is not killed). Each is a process of its own, forked from this one
after it imported the app (a fresh interpreter would spend seconds of CPU importing torch for
each; this process starts no thread before it forks), with the audit hook of its SPEC
installed. After each run, OUT/runs/NAME.json holds its exit status (the negative signal
number where a signal ended it), its output, where it died, and the SHA-256 of every file
under OUT then, which the test compares between runs.

SPEC: {"die": [EVENTS, GLOB, N], "arm": [EVENT, GLOB], "full": BYTES, "mid_file": BYTES}

- EVENTS names Python audit events (PEP 578), which the standard library raises before it
  acts, separated by "|": "open" (only opens that may write count), "os.rename"
  (os.rename and os.replace), "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree". GLOB is
  matched (fnmatch) against the path the call names: a name alone where it gives a folder's
  descriptor, as shutil.rmtree's unlinks do. (What a library writes from C or Rust, as
  safetensors does, raises no event: aim at the Python call before it.)
- The run kills itself at the N-th matching event (counted from 1), before the call acts;
  with "arm", only events after the first that matches "arm" count.
- With "full", it does not die there: the call acts, and from then on every write that
  would take a file past BYTES fails (RLIMIT_FSIZE: EFBIG, as a full disk fails it with
  ENOSPC; Python ignores SIGXFSZ). With "mid_file", such a write kills it instead
  (SIGXFSZ's own action): it dies in the middle of writing a file.

The app's code runs unchanged: nothing is mocked, the kernel does the killing or refuses the
write.
"""

import contextlib
import fnmatch
import hashlib
import json
import os
import resource
import signal
import sys
import threading
import traceback
from pathlib import Path

# What a run imports only as it needs it (the optimizer's torch._dynamo, the plots'
# matplotlib, the export's transformers): imported here once, not in every run.
import matplotlib.backends.backend_agg  # noqa: F401
import matplotlib.figure  # noqa: F401
import torch._dynamo  # noqa: F401
from transformers import MixtralConfig  # noqa: F401

import te_mixtral.training.loop  # noqa: F401
from te_mixtral.cli import main

REPO = Path(__file__).resolve().parents[2]
EVENTS = ("open", "os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.rmtree")
WRITES = set("wax+")  # an open mode that may write


def event_path(event: str, args: tuple) -> str | None:
    """The path an audited call acts on; None for an open that only reads."""
    if event == "open":
        path, mode, flags = args
        writes = WRITES & set(mode) if mode is not None else flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        return os.fsdecode(path) if writes and isinstance(path, (str, bytes, os.PathLike)) else None
    return os.fsdecode(args[0]) if isinstance(args[0], (str, bytes, os.PathLike)) else None


def kill_at(spec: dict, log: Path) -> None:
    """Install the audit hook that ends this process where `spec` says (module docstring)."""
    die_events, pattern, count = spec["die"]
    armed, seen = "arm" not in spec, 0
    if "mid_file" in spec:  # here: a signal's handling can be changed in the main thread only
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)

    def hook(event: str, args: tuple) -> None:
        nonlocal armed, seen
        if event not in EVENTS or (path := event_path(event, args)) is None:
            return
        if not armed:
            armed = event == spec["arm"][0] and fnmatch.fnmatch(path, spec["arm"][1])
            return
        if event in die_events.split("|") and fnmatch.fnmatch(path, pattern):
            seen += 1
            if seen == count:
                log.write_text(json.dumps([event, path]))
                limit = spec.get("full", spec.get("mid_file"))
                if limit is None:
                    os.kill(os.getpid(), signal.SIGKILL)
                resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    sys.addaudithook(hook)


def run(out: Path, job: dict) -> dict:
    """Fork, run the app in the child as `python run_finetune_ep.py ARGV` would, wait."""
    died_at = out / f"{job['name']}.died_at"
    # Pipes, not files: a file size limit (`full`, `mid_file`) would cut the output short.
    pipes = [os.pipe(), os.pipe()]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: whatever happens, it never returns into the parent's code
        code = 1
        try:
            for fd, (read, write) in zip((1, 2), pipes):
                os.dup2(write, fd)
                os.close(read)
                os.close(write)
            sys.argv = [str(REPO / "run_finetune_ep.py"), *job["argv"]]
            if "die" in job:
                kill_at(job["die"], died_at)
            code = main(job["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    output = {}  # read as it comes: a pipe holds 64 KiB, and the child waits while it is full

    def read(name: str, fd: int) -> None:
        with os.fdopen(fd, errors="replace") as stream:
            output[name] = stream.read()

    readers = []
    for name, (read_end, write_end) in zip(("stdout", "stderr"), pipes):
        os.close(write_end)
        readers.append(threading.Thread(target=read, args=(name, read_end)))
        readers[-1].start()
    for reader in readers:
        reader.join()
    status = os.waitpid(pid, 0)[1]
    return {"status": os.waitstatus_to_exitcode(status), "died_at": json.loads(died_at.read_text())
            if died_at.exists() else None, **output}


def hashes(out: Path) -> dict[str, str]:
    """{path under `out`: SHA-256} of every file (the runs' records left out)."""
    return {str(path.relative_to(out)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(out.rglob("*")) if path.is_file() and path.parent != out / "runs"}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    records = out / "runs"
    records.mkdir(parents=True)
    os.chdir(REPO)
    for job in json.loads(sys.argv[2]):
        record = run(records, job)
        (records / f"{job['name']}.json").write_text(json.dumps({**record, "files": hashes(out)}, indent=1))
