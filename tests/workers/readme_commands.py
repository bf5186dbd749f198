"""Run README command lines as a user would, from a folder of their own, one after another.

Usage: python tests/workers/readme_commands.py FOLDER COMMAND...

FOLDER becomes a user's working folder: the repository's `run_finetune_ep.py`, `configs/`,
`examples/` and `scripts/` linked in, so the commands' relative paths read as in the README,
and what they write (`runs/`, `ckpt/`, `finetuned/`) lands there. Each COMMAND runs through
the shell, its `python`, `torchrun` and `accelerate` this interpreter's. Writes
FOLDER/outcomes.json: [{"command", "returncode", "stdout", "stderr"}] in order.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LINKED = ("run_finetune_ep.py", "configs", "examples", "scripts")
# The commands' launchers, as this interpreter runs them (a shell's may be another Python's).
LAUNCHERS = {"python": 'exec "{python}" "$@"', "torchrun": 'exec "{python}" -m torch.distributed.run "$@"',
             "accelerate": 'exec "{python}" -m accelerate.commands.accelerate_cli "$@"'}


def user_folder(folder: Path) -> dict[str, str]:
    """Make `folder` a user's working folder; the environment its commands run in."""
    for name in LINKED:
        (folder / name).symlink_to(REPO / name)
    bin_dir = folder / ".bin"
    bin_dir.mkdir()
    for name, body in LAUNCHERS.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body.format(python=sys.executable)}\n")
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:  # torchrun's default port may be another job's: a free one, by its own variable
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PET_MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1"}


def main(folder: Path, commands: list[str]) -> None:
    env = user_folder(folder)
    outcomes = []
    for command in commands:
        proc = subprocess.run(command, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=300)
        outcomes.append({"command": command, "returncode": proc.returncode, "stdout": proc.stdout,
                         "stderr": proc.stderr})
    (folder / "outcomes.json").write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
