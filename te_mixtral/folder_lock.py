"""One run at a time in a folder: a lock that the output, checkpoint and export folders
(`save_hf`, `save_adapter`) carry while a run writes them.

Two runs writing one folder at once would each think the folder theirs: one replaces the
other's results.json, their steps.jsonl lines interleave, one prunes the other's
checkpoints while the other still reports them intact, and one export deletes the other's
temporary folder while it is written. So rank 0 takes an exclusive
`fcntl.flock` on `LOCK_FILE` in each folder before it writes there, and holds it for the
life of the run; a second run is refused in one line that names the first (its pid, host
and start, which the holder writes into the file).

Why flock: the operating system releases it when the holder's process ends, however it
ends (SIGKILL, the OOM killer, a lost node's reboot), so a dead run never leaves a folder
locked and nobody must delete a stale lock by hand. The file itself stays (deleting it on
release would let a third run lock a new file while a second holds the old one); its
content is only ever a note, never the lock.

Pitfall: flock is advisory and local to a machine's view of the file. Two hosts mounting
one NFS folder see each other's locks only where the NFS client maps flock to NFS locks
(Linux has done so since 2.6.12); a filesystem that cannot lock at all is reported, not
ignored.
"""

import contextlib
import fcntl
import os
import socket
from datetime import datetime
from pathlib import Path

from te_mixtral.errors import UserError
from te_mixtral.files import require_writable

LOCK_FILE = ".te_mixtral.lock"


class FolderLocks(contextlib.ExitStack):
    """The folders this process holds; all released when the `with` block ends (and by the
    operating system if the process dies first)."""

    def __init__(self):
        super().__init__()
        # Resolved. One folder in two roles (output and checkpoints) is locked once: a second
        # flock of it, on a file opened again, would find this run in the way of itself.
        self.held: set[Path] = set()

    def claim(self, folder: Path, what: str) -> None:
        """Lock `folder` (created if missing) for this run, or raise a one-line `UserError`
        naming the run that holds it; `what` names the folder's role ("output_dir")."""
        require_writable(folder, what)
        if folder.resolve() in self.held:
            return
        path = folder / LOCK_FILE
        lock = path.open("a+")  # not "w": truncating would erase the holder's note before we know we hold it
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.seek(0)
            holder = lock.read().strip() or "a run that has not written its note yet"
            lock.close()
            raise UserError(f"{what} {folder} is in use by another run ({holder}); wait for it to end, or choose "
                            f"another folder") from None
        except OSError as e:
            lock.close()
            raise UserError(f"cannot lock {what} {folder} against a second run: {e.strerror}") from None
        self.callback(lock.close)  # closing the file releases the lock
        self.held.add(folder.resolve())
        lock.truncate(0)
        started = datetime.now().isoformat(timespec="seconds")
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        lock.flush()
