"""Who this process is, as its launcher told it: torchrun, Slurm, or an MPI launcher.

:func:`read_env` reads, in this order, torchrun's variables (``RANK``, ``WORLD_SIZE``, ...),
Slurm's (``SLURM_PROCID``, ``SLURM_NTASKS``, ...), then those of MPI launchers
(``mpirun``/``mpiexec`` of Open MPI, MPICH, Intel MPI, MVAPICH; ``srun --mpi=pmix``).
Variables that contradict each other stop the job with one line instead of giving two
processes the same rank. Under an MPI launcher nothing sets ``MASTER_ADDR``:
:func:`agree_rendezvous` has rank 0 choose the address and port and MPI tell the others.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import NamedTuple

__all__ = ["ProcessEnv", "MPI_VARIABLES", "read_env", "mpi_launched", "reports_launcher_errors", "agree_rendezvous"]


@dataclass(frozen=True)
class ProcessEnv:
    """Who this process is, as the launcher told it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    #: ``torchrun``, ``slurm`` or ``mpi``: whose variables these are.
    launcher: str = "torchrun"


class _Family(NamedTuple):
    rank: str
    size: str | None
    local_rank: str | None
    local_size: str | None


#: MPI launchers' variables (rank, size, node-local rank, node-local size), in reading order.
MPI_VARIABLES = (
    _Family("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    _Family("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # MPICH and Intel MPI (Hydra)
    _Family("PMIX_RANK", None, None, None),  # PMIx (srun --mpi=pmix, Open MPI 5): rank only
    _Family("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
)
_TORCHRUN = _Family("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def _int(env: Mapping[str, str], name: str | None) -> int | None:
    if name is None or not env.get(name):
        return None
    value = env[name]
    if not value.strip().isdigit():
        raise ValueError(f"{name}={value!r}: a launcher variable must be a non-negative integer")
    return int(value)


def _read(env: Mapping[str, str], family: _Family, size: int | None = None) -> tuple[int, int, int, int]:
    """(rank, size, local rank, local size) from ``family``, checked for consistency."""
    rank = _int(env, family.rank)
    size = _int(env, family.size) if family.size else size
    if size is None:
        raise ValueError(
            f"{family.rank}={env[family.rank]} is set but no variable gives the number of processes "
            f"(WORLD_SIZE, SLURM_NTASKS, OMPI_COMM_WORLD_SIZE, PMI_SIZE or MV2_COMM_WORLD_SIZE): start the job "
            f"with torchrun, srun or mpirun, which set both"
        )
    if size < 1 or rank >= size:
        raise ValueError(
            f"{family.rank}={rank} but {family.size or 'the process count'}={size}: "
            f"a rank must be below the number of processes"
        )
    local_rank = _int(env, family.local_rank)
    local_size = _int(env, family.local_size)
    local_rank = 0 if local_rank is None else local_rank
    local_size = size if local_size is None else local_size
    if not local_rank < local_size <= size:
        raise ValueError(
            f"{family.local_rank}={local_rank}, {family.local_size or 'local size'}={local_size} and "
            f"{family.size or 'size'}={size} do not fit: need local rank < local size <= size"
        )
    return rank, size, local_rank, local_size


def _mpi(env: Mapping[str, str], fallback_size: int | None) -> tuple[tuple[int, int, int, int], str] | None:
    """The MPI launcher's view, or ``None``; every MPI family present must agree on rank and size."""
    present = [f for f in MPI_VARIABLES if env.get(f.rank)]
    sized = [f for f in present if f.size and env.get(f.size)]
    size = _int(env, sized[0].size) if sized else fallback_size
    views = [(f, _read(env, f, size)) for f in present]
    if not views:
        return None
    first, mine = views[0]
    for family, other in views[1:]:
        if other[:2] != mine[:2]:
            raise ValueError(
                f"mismatched launcher variables: {_describe(env, first)} but {_describe(env, family)}: "
                f"they must come from the one launcher that started this process"
            )
    return mine, _describe(env, first)


def _describe(env: Mapping[str, str], family: _Family) -> str:
    return " ".join(f"{v}={env[v]}" for v in (family.rank, family.size) if v and env.get(v))


def mpi_launched(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an MPI launcher started this process (one of :data:`MPI_VARIABLES`' ranks is set)."""
    env = os.environ if environ is None else environ
    return any(env.get(f.rank) for f in MPI_VARIABLES)


def read_env(environ: Mapping[str, str] | None = None) -> ProcessEnv | None:
    """Read torchrun's variables, then Slurm's, then an MPI launcher's; ``None`` when none is set.

    Raises ``ValueError`` (one line) for incomplete or contradictory variables: a rank without
    a process count, a rank beyond it, or Slurm and MPI launchers giving different ranks
    (``mpirun`` inside an allocation without ``srun``).
    """
    env = os.environ if environ is None else environ
    port = _int(env, "MASTER_PORT")
    addr = env.get("MASTER_ADDR") or None
    if env.get("RANK") or env.get("WORLD_SIZE"):
        if not (env.get("RANK") and env.get("WORLD_SIZE")):
            given, missing = ("RANK", "WORLD_SIZE") if env.get("RANK") else ("WORLD_SIZE", "RANK")
            raise ValueError(
                f"{given} is set but {missing} is not: start the job with torchrun (which sets both) or unset {given}"
            )
        rank, size, local_rank, local_size = _read(env, _TORCHRUN)
        return ProcessEnv(rank, size, local_rank, local_size, addr, port, "torchrun")
    slurm = None
    if env.get("SLURM_PROCID") and env.get("SLURM_NTASKS"):
        per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        family = _Family("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)
        rank, size, local_rank, _ = _read(env, family)
        slurm = (rank, size, local_rank, int(per_node) if per_node.isdigit() else size)
    mpi = _mpi(env, slurm[1] if slurm else None)
    if slurm is not None:
        if mpi is not None and mpi[0][:2] != slurm[:2]:
            raise ValueError(
                f"mismatched launcher variables: SLURM_PROCID={slurm[0]} SLURM_NTASKS={slurm[1]} but {mpi[1]}: "
                f"inside a Slurm allocation start the job with srun --mpi=pmix (or unset SLURM_PROCID and "
                f"SLURM_NTASKS to let mpirun's variables count)"
            )
        return ProcessEnv(*slurm, addr, port, "slurm")
    if mpi is not None:
        return ProcessEnv(*mpi[0], addr, port, "mpi")
    return None


def reports_launcher_errors(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process prints :func:`read_env`'s error, so that a job prints it once.

    The process of rank 0 by the innermost launcher speaks (torchrun's variables, then an MPI
    launcher's, then Slurm's: ``mpirun`` inside an allocation gives every process the batch
    step's ``SLURM_PROCID``), and so does any process whose innermost rank is unreadable, has
    no process count, or is out of range: then there may be no rank 0.
    """
    env = os.environ if environ is None else environ
    for family in (_TORCHRUN, *MPI_VARIABLES, _Family("SLURM_PROCID", "SLURM_NTASKS", None, None)):
        rank = env.get(family.rank, "").strip()
        if not rank:
            continue
        # PMIx gives no count of its own: srun's (or another launcher's) counts the same processes.
        sizes = [family.size] if family.size else ["SLURM_NTASKS", *(f.size for f in MPI_VARIABLES if f.size)]
        size = next((env[v].strip() for v in sizes if env.get(v, "").strip()), "")
        if not (rank.isdigit() and size.isdigit()) or int(rank) >= int(size):
            return True
        return int(rank) == 0
    return True


def _host_address(hostnames: list[str]) -> str:
    # All ranks on one node: loopback needs no name service. Otherwise rank 0's host name,
    # which the other nodes of a cluster resolve.
    return "127.0.0.1" if len(set(hostnames)) == 1 else hostnames[0]


def _bind_gpu_before_mpi(env: ProcessEnv) -> None:
    """On a GPU node, make this rank's GPU current before MPI initialises: a CUDA-aware MPI binds its
    communicator resources to the current device at MPI_Init, which would otherwise be GPU 0 for every
    rank. Asking whether CUDA is available does not create a context (torch asks NVML); on a node
    without GPUs nothing happens. Not run on this project's CPU machines."""
    import torch

    if torch.cuda.is_available():
        from .device import cuda_device

        torch.cuda.set_device(cuda_device(env.local_rank))


def agree_rendezvous(env: ProcessEnv) -> ProcessEnv:
    """Under an MPI launcher without ``MASTER_ADDR``/``MASTER_PORT``: rank 0 picks its address
    and a free port, MPI broadcasts them, and they are exported for torch's rendezvous.

    A collective over ``MPI_COMM_WORLD`` (every rank calls it). Other launchers, and MPI
    jobs that set both variables, are returned unchanged.
    """
    if env.launcher != "mpi" or (env.master_addr and env.master_port):
        return env
    _bind_gpu_before_mpi(env)
    from ..comm.backends import get_mpi

    world = get_mpi().COMM_WORLD
    if world.Get_size() != env.world_size or world.Get_rank() != env.rank:
        raise ValueError(
            f"the launcher's variables say rank {env.rank} of {env.world_size} but MPI_COMM_WORLD says rank "
            f"{world.Get_rank()} of {world.Get_size()}: mpi4py must use the MPI library of the launcher (install "
            f"mpi4py against it, or start the job with the mpirun of the installed one)"
        )
    hostnames = world.allgather(socket.gethostname())
    choice = None
    if env.rank == 0:
        from .launch import free_port

        choice = (env.master_addr or _host_address(hostnames), env.master_port or free_port())
    addr, port = world.bcast(choice, root=0)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    return replace(env, master_addr=addr, master_port=port)
