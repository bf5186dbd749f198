"""Reading torch.distributed.checkpoint's index without letting it run code.

DCP writes beside its data files an index, `.metadata`: which file holds which slice of which
tensor. It is a pickle, and DCP reads it with `pickle.load`, which builds whatever objects the
file names: a checkpoint folder from elsewhere (or one whose files were replaced) could run
any code as it loads. The data files are safe already (DCP reads tensors with
`torch.load(weights_only=True)`); here the index is read by an unpickler that builds only
what a DCP index is made of, and DCP is handed the result instead of unpickling the file
itself. A file that names anything else is refused in one line, and nothing in it runs.
"""

import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from te_mixtral.errors import UserError, first_line

INDEX = ".metadata"  # DCP's index of a checkpoint folder: a pickle


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index and nothing else: DCP's own classes, torch's sizes, dtypes and
    layouts, and paths (see the module)."""

    # Exact names: find_class also resolves dotted ones ("torch.load" from a module that imports torch).
    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "StorageMeta", "TensorProperties",
                                                  "TensorStorageMetadata", "BytesStorageMetadata",
                                                  "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"} | {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"PosixPath", "WindowsPath"},
    }

    def find_class(self, module: str, name: str):
        if name not in self.ALLOWED.get(module, ()):
            raise pickle.UnpicklingError(f"it would build {module}.{name}")
        return super().find_class(module, name)


def read_index(path: Path) -> Metadata:
    """The DCP index at `path`, unpickled by `_IndexUnpickler`; a `UserError` if it is not one."""
    try:
        with open(path, "rb") as f:
            index = _IndexUnpickler(f).load()
    except Exception as e:  # whatever a damaged pickle raises
        raise UserError(f"checkpoint file {path} is not a checkpoint index ({first_line(e)}); refusing to "
                        f"read it") from None
    if not isinstance(index, Metadata):
        raise UserError(f"checkpoint file {path} is not a checkpoint index (it holds a {type(index).__name__})")
    return index


class IndexedReader(FileSystemReader):
    """DCP's file reader, handed the index `read_index` read instead of unpickling it itself."""

    def __init__(self, folder: Path, index: Metadata):
        super().__init__(folder)
        self.index = index

    def read_metadata(self, *args, **kwargs) -> Metadata:
        self.index.storage_meta = self.index.storage_meta or StorageMeta()
        self.index.storage_meta.load_id = self.load_id
        return self.index
