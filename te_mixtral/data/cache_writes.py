"""A full disk under `datasets`' cache is one line naming the cache, not a traceback.

`datasets` writes the records it reads from files, and the result of each `map` or `filter`
over them (the blank records left out, the chat layouts read, the tokens), into its cache
(`HF_DATASETS_CACHE`, by default ~/.cache/huggingface/datasets) as Arrow files. On a full
disk such a write fails deep inside it, with an OSError that names no file, or is followed by
another error of its cleanup's ("I/O operation on closed file"), and reading a data file
fails with it: the run would blame the data file, or end in a traceback. An error whose chain
holds one that only a write raises (`WRITE_ERRNOS`) is said as the cache's instead.
"""

import contextlib
import errno
import os
from collections.abc import Iterator

import datasets

from te_mixtral.errors import UserError, WriteFailed

# What a write fails with and a read never does: no space or quota left, a file past its size
# limit, a read-only file system.
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS}


def cache_write_failure(error: BaseException) -> WriteFailed | None:
    """The one-line error for `datasets`' cache where `error`, or an error it was raised from
    or while handling, is a failed write; None otherwise."""
    seen = []
    while error is not None and error not in seen:
        if isinstance(error, OSError) and error.errno in WRITE_ERRNOS:
            return WriteFailed(f"cannot write the datasets cache {datasets.config.HF_DATASETS_CACHE}: "
                               f"{os.strerror(error.errno)}; free space there, or set HF_DATASETS_CACHE to a folder "
                               f"with room")
        seen.append(error)
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def writing_cache() -> Iterator[None]:
    """Say a failed write of `datasets`' cache inside the block in one line (module docstring)."""
    try:
        yield
    except UserError:  # said already (the tokenizer's own cache, a data file's fault)
        raise
    except Exception as e:
        failure = cache_write_failure(e)
        if failure is None:
            raise
        raise failure from None
