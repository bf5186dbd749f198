"""Files that are whole or absent, and folders checked before a long run needs them.

Results, training checkpoints and Hugging Face exports must never be left half written:
a run killed at any instant, or a disk that fills up, leaves either the old version or the
new one. The recipe is the same everywhere:

1. write to a temporary name in the *same folder* (`os.replace` and `os.rename` are atomic
   only within one filesystem, and /tmp often is another);
2. fsync the data, so the bytes are on disk before a name points at them;
3. rename over the final name;
4. fsync the folder, since the rename itself is an entry in the folder's list of names.

A long run should also fail at its start, not after hours, when the folder it will write to
is not writable or cannot hold what it will write: `require_writable` and
`require_free_space` say so with a message a user can act on. A write that fails anyway
(the disk filled up meanwhile) ends in one line, `write_failure`, not a traceback.

A temporary or backup folder beside an output (`DIR.tmp`, `DIR.old`, a checkpoint's
`step-N.tmp`) is deleted only when it proves te_mixtral made it: `make_scratch` writes
`SCRATCH_MARKER` into it as it creates it, and `remove_scratch` refuses, in one line naming
it, a folder of that name without the marker (the user's own folder that happens to have
the name). Never by following a symbolic link: the link is not the folder it points to.
Neither making nor deleting a folder is one step, so a run killed midway (or a disk full
as the marker is written) must not leave a folder that the next run takes for the user's:
`remove_marked` deletes the marker last, and an empty folder counts as te_mixtral's (it
holds nothing to lose: a kill between a `mkdir` and the marker, or just before the last
`rmdir`, leaves one).

Pitfall: a full disk does not always raise `OSError`. `torch.save` raises a `RuntimeError`
("PytorchStreamWriter failed writing file" or "unexpected pos"), safetensors its own
`SafetensorError`; the writers catch those too.
"""

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from te_mixtral.errors import Interrupted, UserError, WriteFailed, first_line


def fsync_path(path: Path) -> None:
    """Flush a file, or a folder's list of names (what makes a rename durable), to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path: Path, mode: str = "w") -> Iterator[IO]:
    """A file, opened in `mode`, that replaces `path` in one step when the `with` block ends:
    readers see the old file or the new one, never part of one (a run killed while it writes
    leaves the old one, and a hidden temporary beside it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it owner-only; results and checkpoints are meant to be shared
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` in one step: readers see the old file or the new one."""
    with atomic_file(path) as f:
        f.write(text)


SCRATCH_MARKER = ".te_mixtral_scratch"  # in every temporary or backup folder te_mixtral makes


def sibling(path: Path, suffix: str) -> Path:
    """`DIR.tmp` or `DIR.old` beside `DIR`."""
    return path.with_name(path.name + suffix)


def staged_beside(folder: Path) -> Path:
    """Where a folder that is written into `DIR.tmp` and moved in lands, its links followed:
    its `DIR.tmp` and `DIR.old` go beside that, since a rename moves a file within one
    filesystem alone, and a link (to a larger disk) may name a folder on another."""
    return folder.resolve()


def make_scratch(path: Path) -> None:
    """Create the folder `path` (not there yet) and mark it as te_mixtral's to delete."""
    path.mkdir(parents=True)
    try:
        (path / SCRATCH_MARKER).write_text("made by te_mixtral as a temporary or backup folder; it deletes it\n")
    except OSError:  # a full disk: no marker, so no folder either
        (path / SCRATCH_MARKER).unlink(missing_ok=True)
        path.rmdir()
        raise


def is_empty_folder(path: Path) -> bool:
    """Whether `path` is a folder (not a link to one) that holds nothing."""
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def is_scratch(path: Path) -> bool:
    """Whether `path` is a folder (not a link to one) that `make_scratch` made, or an empty one
    (see the module docstring)."""
    return path.is_dir() and not path.is_symlink() and ((path / SCRATCH_MARKER).is_file() or is_empty_folder(path))


def check_scratch(path: Path, what: str) -> None:
    """Refuse, in one line naming it, a folder at `path` that te_mixtral would delete (`what`
    it would be) but did not make."""
    if (path.exists() or path.is_symlink()) and not is_scratch(path):
        raise UserError(f"{path} is in the way: te_mixtral writes {what} there and deletes it, and it has no "
                        f"{SCRATCH_MARKER} to show te_mixtral made it; move it away or delete it yourself")


def remove_scratch(path: Path, what: str) -> None:
    """Delete the folder `path` if te_mixtral made it (`check_scratch` otherwise)."""
    check_scratch(path, what)
    if path.exists():
        remove_marked(path)


def remove_marked(path: Path, marked_by: tuple[str, ...] = ()) -> None:
    """Delete the folder `path`, which its `SCRATCH_MARKER` (or the files `marked_by`) shows
    te_mixtral made, those last: a run killed midway leaves them, or an empty folder, and the
    next run deletes either as its own (`shutil.rmtree` goes in the folder's own order, and
    may leave the rest of the folder without its marker)."""
    markers = (*marked_by, SCRATCH_MARKER)
    for entry in path.iterdir():
        if entry.name not in markers:
            _remove(entry)
    for name in markers:
        (path / name).unlink(missing_ok=True)
    path.rmdir()


def _remove(path: Path) -> None:
    """Delete the file, link or folder (with what it holds) at `path`; a link, not what it points to."""
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def publish_folder(tmp: Path, final: Path) -> None:
    """Rename a finished temporary folder (made by `make_scratch`) to its final name.

    A folder cannot replace a non-empty folder in one rename, so an existing `final` is first
    moved aside to `final.old` and deleted after: a crash between the two renames leaves the
    previous contents under `final.old`, never a mixture. The caller vouches that an
    existing `final` is its own to replace; `final` keeps the marker of the folder it was
    made as.
    """
    fsync_path(tmp)
    if final.exists():
        old = sibling(final, ".old")
        remove_scratch(old, "the folder it replaces")
        os.rename(final, old)
        os.rename(tmp, final)
        remove_marked(old)  # what was `final`
    else:
        os.rename(tmp, final)
    fsync_path(final.parent)


def replace_files(tmp: Path, final: Path, owned: Callable[[str], bool], marker: str) -> None:
    """Move the files of the finished folder `tmp` into `final`, replacing the files there
    whose names `owned` says the writer writes (an earlier version of the same output) and
    keeping every other file (what the user put beside it).

    A set of files, unlike a folder, cannot be replaced in one rename. The earlier files go
    to `final.old` first (`marker`, which says a set is complete, the first of them), then
    the new ones come in, `marker` first under a name of its own (`incoming`, which says that
    `final`'s files of the set are the new set's) and made `marker` last, then `final.old` is
    deleted. `final` never holds files of both sets, and holds `marker` only when its set is
    complete; a crash midway leaves the earlier set whole in `final.old` (as the new files
    come in) or in `final` and `final.old` together (as it goes out), which the next
    replacement puts back together first (`_put_back`). `tmp` was made by `make_scratch`;
    its `SCRATCH_MARKER` stays behind, and `final` never gets one (it is the user's folder).
    """
    fsync_path(tmp)
    if not final.exists():
        os.rename(tmp, final)
        (final / SCRATCH_MARKER).unlink()
        fsync_path(final.parent)
        return
    old = sibling(final, ".old")
    _put_back(final, owned, marker)
    make_scratch(old)
    for path in sorted(final.iterdir(), key=lambda p: p.name != marker):
        if owned(path.name) and (path.is_file() or path.is_dir()):  # a folder of the set moves whole
            os.rename(path, old / path.name)
    incoming = final / _incoming(marker)
    os.rename(tmp / marker, incoming)
    for path in tmp.iterdir():
        if path.name != SCRATCH_MARKER:
            os.rename(path, final / path.name)
    os.rename(incoming, final / marker)
    remove_scratch(tmp, "the export")
    fsync_path(final)
    remove_scratch(old, "the export it replaces")
    fsync_path(final.parent)


def _incoming(marker: str) -> str:
    return f".{marker}.incoming"


def _put_back(final: Path, owned: Callable[[str], bool], marker: str) -> None:
    """Where a `replace_files` into `final` was killed midway, make `final` hold the set it
    was replacing, whole, again, and delete `final.old`. Where `final` holds `marker`, its set
    is whole (nothing had gone out yet, or everything had come in); else the earlier set's
    files in `final.old` go back, after the new set's in `final` are deleted where they had
    started to come in."""
    old = sibling(final, ".old")
    check_scratch(old, "the export it replaces")
    if not old.exists():
        return
    incoming = final / _incoming(marker)
    if not (final / marker).is_file():
        if incoming.exists():
            for path in final.iterdir():
                if owned(path.name):
                    _remove(path)
            incoming.unlink()  # last: while it is there, `final`'s files of the set are known to be the new set's
        for path in sorted(old.iterdir(), key=lambda p: p.name == marker):  # the marker last
            if path.name != SCRATCH_MARKER:
                os.rename(path, final / path.name)
    remove_scratch(old, "the export it replaces")


# What a path that is no regular file is, as a refusal names it.
_KINDS = {stat.S_ISFIFO: "a FIFO (named pipe)", stat.S_ISSOCK: "a socket", stat.S_ISCHR: "a character device",
          stat.S_ISBLK: "a block device", stat.S_ISDIR: "a folder"}


def require_regular_file(path: Path, what: str) -> None:
    """Refuse an input that is there but no regular file, before it is opened: te_mixtral
    reads its inputs whole, and opening a FIFO waits for a writer, reading a device may never
    end. A missing path is the caller's to report."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        kind = next((kind for test, kind in _KINDS.items() if test(mode)), "no regular file")
        raise UserError(f"{what} {path} is not a regular file but {kind}, which te_mixtral cannot read as a whole "
                        f"file: give a file")


def require_writable(path: Path, what: str) -> None:
    """Create `path` and a file in it now, so that a bad path fails before training, not after."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is a file, not a folder: name a folder (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-").close()
    except OSError as e:
        raise UserError(f"{what} {path} is not writable: {e.strerror}") from None


def unwritable(folder: Path) -> tuple[Path, str] | None:
    """Why nothing can be written into `folder` (absolute), where it cannot: the nearest folder
    at or above it that exists (where the missing ones would be made) and its fault, a file in
    the way or no permission (the kernel answers, `os.access`); None where it can."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
        return None
    return existing, "is a file, not a folder" if not existing.is_dir() else "is not writable"


def check_writable(folder: Path, what: str, staged_as: str | None = None) -> None:
    """Refuse, in one line, a folder a run will write into and cannot: the folder itself where
    it exists, else the nearest folder above it (where it will be made); with `staged_as` (a
    sibling's suffix, `.tmp`: the writer writes `DIR.tmp` beside it first, then moves it in),
    the folder it is in too. The kernel answers (`os.access`) and nothing is made, so every
    rank can ask before any of them writes, and before the checks that refuse a folder as
    the wrong one. `require_writable`, which makes the folder, still runs where it is made."""
    path = staged_beside(folder) if staged_as else folder.absolute()
    for place in [path] + ([path.parent] if staged_as else []):
        blocked = unwritable(place)
        if blocked is None:
            continue
        existing, fault = blocked
        if existing == path:
            raise UserError(f"{what} {folder} {fault}")
        if place == path:
            raise UserError(f"{what} {folder} cannot be made: {existing} {fault}")
        raise UserError(f"{what} {folder} is first written as {sibling(path, staged_as).name} beside it, in "
                        f"{existing}, which {fault}")


def require_free_space(path: Path, needed_bytes: int, what: str, reclaimable_bytes: int = 0) -> None:
    """Refuse to start when `path`'s filesystem cannot take `needed_bytes` more; what the
    writer deletes before it writes (`reclaimable_bytes`: leftovers of an interrupted save)
    counts as free."""
    free = shutil.disk_usage(path).free + reclaimable_bytes
    if free < needed_bytes:
        raise UserError(f"not enough free space in {path} for {what}: needs about {size_text(needed_bytes)}, "
                        f"{size_text(free)} free")


def size_text(num_bytes: float) -> str:
    """A size in the binary unit that shows it with three significant digits (`15.1 MiB`,
    `512 B`), so that two sizes side by side show their difference at any scale."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1000 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.3g} {unit}"
        num_bytes /= 1024


def folder_bytes(path: Path) -> int:
    """The bytes of every file under `path` (0 when it does not exist)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def write_failure(what: str, error: Exception) -> WriteFailed:
    """The one-line error for a write of `what` that raised `error` (see the pitfall above).

    A Ctrl-C is no failed write: torch.save reports the `Interrupted` raised in the middle of
    its writing as a `RuntimeError` ("unexpected pos"), the interruption its `__context__`.
    That interruption is raised again here, so the run ends as interrupted (exit 130), not
    as a full disk."""
    cause = error
    while cause is not None:
        if isinstance(cause, Interrupted):
            raise cause
        cause = cause.__cause__ or cause.__context__
    if isinstance(error, OSError) and error.strerror:
        return WriteFailed(f"cannot write {what}: {error.strerror}")
    return WriteFailed(f"cannot write {what}: {first_line(error)} (is the disk full?)")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()
