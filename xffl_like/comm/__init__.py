"""Backend-agnostic collectives and byte transport over ``torch.distributed`` or MPI.

The same code runs over either backend (torchgfn's distributed utilities are the model)::

    from xffl_like import comm
    comm.all_reduce(t, op="AVG", backend="mpi")            # in place, any device
    comm.send(payload, dst=1, backend="torch", tag=3)      # raw bytes, any dtype
    source, data = comm.recv(backend="torch", tag=3)       # from any rank

``backend`` is ``"torch"`` (a ProcessGroup as ``group``, ``None`` = the world) or
``"mpi"`` (an mpi4py communicator, ``None`` = ``MPI.COMM_WORLD``; needs the ``mpi`` extra).
"""

from .backends import BACKENDS, MPI_EXTRA, MPIUnavailable, check_backend, get_mpi, mpi_installed
from .collectives import OPS, all_gather, all_reduce, barrier, broadcast, gather_varlen, get_rank, get_world_size
from .transport import AsyncRecvHandle, AsyncSendHandle, irecv_into, isend, recv, send

__all__ = [
    "BACKENDS",
    "MPI_EXTRA",
    "OPS",
    "AsyncRecvHandle",
    "AsyncSendHandle",
    "MPIUnavailable",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "check_backend",
    "gather_varlen",
    "get_mpi",
    "get_rank",
    "get_world_size",
    "irecv_into",
    "isend",
    "mpi_installed",
    "recv",
    "send",
]
