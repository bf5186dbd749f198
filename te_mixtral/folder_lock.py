"""One run at a time in a folder: a lock that the output, checkpoint and export folders
(`save_hf`, `save_adapter`) carry while a run writes them.

Two runs writing one folder at once would each think the folder theirs: one replaces the
other's results.json, their steps.jsonl lines interleave, one prunes the other's
checkpoints while the other still reports them intact, and one export deletes the other's
temporary folder while it is written. So rank 0 takes an exclusive
`fcntl.flock` on a lock file (`LOCK_FILE` in the folder) before it writes there, and holds it
for the life of the run; a second run is refused in one line that names the first (its pid,
host and start, which the holder writes into the file).

An export folder's lock lives beside it (`NAME.te_mixtral.lock`, `lock_path`), not in it: an
export is pushed to the hub as a folder (`huggingface_hub.upload_folder` uploads hidden files
too), and must hold only what its readers need and its marker (training/outputs.py).

Why flock: the operating system releases it when the holder's process ends, however it
ends (SIGKILL, the OOM killer, a lost node's reboot), so a dead run never leaves a folder
locked and nobody must delete a stale lock by hand. A run that ends deletes its lock file as
it releases it (a lock file belongs to a run in progress); one killed leaves it, and the next
run takes it over. Deleting a lock file others may have opened is safe only because a run
that gets the lock checks that the file it locked is still the one at the path: one deleted
meanwhile (its holder released it as this run locked it) is locked again, made anew. Without
that check a second run could hold the deleted file while a third locks the new one.

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
from te_mixtral.files import require_writable, sibling

LOCK_FILE = ".te_mixtral.lock"


def lock_path(folder: Path, beside: bool = False) -> Path:
    """The lock file of `folder`: in it, or `beside` it (an export's: the module docstring)."""
    return sibling(folder.resolve(), LOCK_FILE) if beside else folder / LOCK_FILE


def _same_file(lock, path: Path) -> bool:
    """Whether the open file `lock` is still the file at `path` (not deleted or replaced)."""
    try:
        at_path = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(lock.fileno())
    return (held.st_dev, held.st_ino) == (at_path.st_dev, at_path.st_ino)


class FolderLocks(contextlib.ExitStack):
    """The folders this process holds; all released when the `with` block ends (and by the
    operating system if the process dies first)."""

    def __init__(self):
        super().__init__()
        # Resolved. One folder in two roles (output and checkpoints) is locked once: a second
        # flock of it, on a file opened again, would find this run in the way of itself.
        self.held: set[Path] = set()

    def claim(self, folder: Path, what: str, beside: bool = False) -> None:
        """Lock `folder` for this run, or raise a one-line `UserError` naming the run that holds
        it; `what` names the folder's role ("output_dir"). The folder is created if missing,
        unless its lock is `beside` it (an export's, made where the export is written)."""
        if beside:
            require_writable(folder.resolve().parent, f"{what}'s parent folder")
        else:
            require_writable(folder, what)
        if folder.resolve() in self.held:
            return
        path = lock_path(folder, beside)
        while True:
            try:
                lock = path.open("a+")  # not "w": truncating would erase the holder's note before we know we hold it
            except OSError as e:  # a folder there, or a file another user's run left
                raise UserError(f"cannot lock {what} {folder} against a second run: its lock file {path} cannot be "
                                f"opened: {e.strerror}") from None
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                holder = lock.read().strip() or "a run that has not written its note yet"
                lock.close()
                raise UserError(f"{what} {folder} is in use by another run ({holder}); wait for it to end, or "
                                f"choose another folder") from None
            except OSError as e:
                lock.close()
                raise UserError(f"cannot lock {what} {folder} against a second run: {e.strerror}") from None
            if _same_file(lock, path):
                break
            lock.close()  # its holder deleted it as it released it: lock the file at the path now
        self.callback(self._release, lock, path)
        self.held.add(folder.resolve())
        lock.truncate(0)
        started = datetime.now().isoformat(timespec="seconds")
        lock.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
        lock.flush()

    @staticmethod
    def _release(lock, path: Path) -> None:
        """Delete the lock file while it is still held, then release it (closing the file). A
        file that cannot be deleted stays, as a killed run's does: the next run takes it over."""
        with lock, contextlib.suppress(OSError):
            if _same_file(lock, path):
                path.unlink()
