"""The two backends of :mod:`xffl_like.comm`: names, default groups, and mpi4py loaded lazily.

``torch`` talks through ``torch.distributed`` (a ProcessGroup; ``None`` is the world);
``mpi`` through mpi4py (a communicator; ``None`` is ``MPI.COMM_WORLD``). mpi4py is only
imported when the MPI backend is used: importing it initialises MPI.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch

__all__ = [
    "BACKENDS",
    "MPI_EXTRA",
    "MPIUnavailable",
    "as_bytes",
    "check_backend",
    "get_mpi",
    "handles_cpu",
    "mpi_group",
    "mpi_installed",
    "to_host_contiguous",
]

BACKENDS = ("torch", "mpi")
#: What to install for the MPI backend (mpi4py plus an MPI runtime, see pyproject.toml).
MPI_EXTRA = "pip install -e '.[mpi]'"


class MPIUnavailable(ImportError):
    """The MPI backend was asked for but mpi4py or an MPI library is missing."""


def check_backend(backend: str) -> str:
    """Return ``backend`` if it is one of :data:`BACKENDS`, else raise one ``ValueError``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: valid backends are {', '.join(map(repr, BACKENDS))}")
    return backend


def mpi_installed() -> bool:
    """Whether mpi4py is importable, asked without importing it (no MPI initialisation)."""
    try:
        return importlib.util.find_spec("mpi4py") is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules: blocked
        return False


def get_mpi():
    """The ``mpi4py.MPI`` module; :class:`MPIUnavailable` with the install line when absent."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError, OSError) as exc:  # no mpi4py, or mpi4py without an MPI library
        cause = "mpi4py is not installed" if isinstance(exc, ImportError) else f"mpi4py cannot load MPI ({exc})"
        raise MPIUnavailable(
            f"the MPI backend needs mpi4py and an MPI runtime, but {cause}: install the mpi extra ({MPI_EXTRA})"
        ) from None
    return MPI


def handles_cpu(group: Any = None) -> bool:
    """Whether a torch process group moves CPU tensors: gloo or mpi, alone or beside nccl
    (``dist.get_backend`` names a mixed group ``cpu:gloo,cuda:nccl``); not nccl alone."""
    import torch.distributed as dist

    return dist.get_backend(group) != "nccl"


def mpi_group(group: Any):
    """``group`` or, when ``None``, ``MPI.COMM_WORLD``."""
    return get_mpi().COMM_WORLD if group is None else group


def to_host_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``tensor``'s values: ``tensor`` itself when it already is one
    (so MPI works in place on CPU), a copy otherwise (the MPI paths go through host memory)."""
    return tensor.detach().to("cpu").contiguous()


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``tensor`` as a flat uint8 tensor (a view when it is contiguous):
    reinterpreted, never cast, so every dtype (bf16 included) travels exactly."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8)
