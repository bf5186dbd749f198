"""Run README command sequences as a user would, each from a folder of its own, in order.

Usage: python tests/workers/readme_commands.py FOLDER SEQUENCES

SEQUENCES is a JSON list of lists of command lines (a README bash block each). Sequence i runs
in FOLDER/i, made a user's working folder: the repository's `run_finetune_ep.py`, `configs/`,
`examples/` and `scripts/` linked in, so the commands' relative paths read as in the README,
and what they write (`runs/`, `ckpt/`, `finetuned/`) lands there for the commands after them.
Each command runs through the shell, its `python`, `torchrun` and `accelerate` this
interpreter's. Writes FOLDER/outcomes.json: [{"sequence", "command", "returncode", "stdout",
"stderr"}] in order.
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


def main(folder: Path, sequences: list[list[str]]) -> None:
    outcomes = []
    for i, sequence in enumerate(sequences):
        (folder / str(i)).mkdir()
        env = user_folder(folder / str(i))
        for command in sequence:
            proc = subprocess.run(command, shell=True, cwd=folder / str(i), env=env, capture_output=True, text=True,
                                  timeout=300)
            outcomes.append({"sequence": i, "command": command, "returncode": proc.returncode, "stdout": proc.stdout,
                             "stderr": proc.stderr})
    (folder / "outcomes.json").write_text(json.dumps(outcomes, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), json.loads(sys.argv[2]))
