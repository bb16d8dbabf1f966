"""Reading DCP's files without executing code: ``.metadata``'s pickle through an unpickler that admits only
DCP's metadata classes (:class:`SafeFileSystemReader`), and a load planner that refuses pickled objects
(:class:`SafeLoadPlanner`); DCP reads tensors with ``torch.load(weights_only=True)`` itself.

Apart from :mod:`.store` (the directory on disk, no torch): importing ``torch.distributed.checkpoint`` costs
about 0.7 s of CPU, which a launcher that checks a fresh job's configuration does not need to pay.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader

__all__ = ["SafeFileSystemReader", "SafeLoadPlanner", "read_metadata"]

_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, ``torch.Size``, dtypes and layouts, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a checkpoint's .metadata")


class SafeFileSystemReader(FileSystemReader):
    """DCP's reader with a restricted unpickler for ``.metadata``."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        from torch.distributed.checkpoint.metadata import StorageMeta

        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as fh:
            metadata = _MetadataUnpickler(fh).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Our checkpoints hold tensors only; a pickled object (which DCP would ``torch.load``
    with ``weights_only=False``) is refused."""

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; refusing to load it")


def read_metadata(path: Path):
    """DCP's metadata of checkpoint ``path`` (``ValueError`` if missing, truncated or unsafe)."""
    try:
        return SafeFileSystemReader(str(path)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{Path(path) / '.metadata'} cannot be read ({type(exc).__name__}: {exc})") from None
