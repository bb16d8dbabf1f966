"""What the aggregation needs from the backend, set up once when a strategy is built:
the reduce op that forms the mean (gloo's AVG probed once), the ``collective`` check, and the
``mpi`` transport's checks and communicator. Read by :func:`.builders.build_strategy` and the
launcher's validation; the executor then only reads the :class:`~.strategy.Strategy`.
"""

from __future__ import annotations

import functools
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config.errors import ConfigError

__all__ = ["check_collective", "check_mpi_transport", "gloo_has_avg", "mpi_communicator", "reduce_op"]


def check_collective(collective: str | None, backend: str, key: str = "collective") -> None:
    """Refuse ``exchange`` on nccl with one line. The exchange is gloo's remedy (one message per
    peer instead of a ring synchronised per segment, no AVG needed); NCCL's all-reduce has AVG
    and PREMUL_SUM built in, and the exchange's point-to-point path is not exercised there."""
    if collective == "exchange" and backend == "nccl":
        raise ValueError(f"{key}=exchange is for gloo; on nccl use {key}=all_reduce (or null: the backend's default)")


def reduce_op(backend: str) -> str:
    """How the executor forms the mean on ``backend`` (see :attr:`Strategy.reduce_op`)."""
    if backend == "nccl":
        return "premul_sum"
    if backend == "gloo" and gloo_has_avg():
        return "avg"
    return "sum"


@functools.cache
def gloo_has_avg() -> bool:
    """Whether this torch's gloo supports ReduceOp.AVG, asked of a local one-rank group
    (no communication, so every rank gets the same answer without agreeing on it)."""
    try:
        group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        probe = torch.full((2,), 3.0)
        group.allreduce([probe], opts).wait()
        return bool((probe == 3.0).all())
    except Exception:  # noqa: BLE001 - any failure means: do not use it
        return False


def check_mpi_transport() -> None:
    """``strategy.transport=mpi`` needs mpi4py and processes started by an MPI launcher (so
    that MPI connects them); checked without initialising MPI."""
    from ..comm import MPI_EXTRA, mpi_installed
    from ..distributed.env import mpi_launched

    if not mpi_installed():
        raise ConfigError(
            f"strategy.transport=mpi needs mpi4py and an MPI runtime: install the mpi extra ({MPI_EXTRA})"
        )
    if not mpi_launched():
        raise ConfigError(
            "strategy.transport=mpi needs the job started by an MPI launcher, e.g. "
            "mpirun -n 4 python -m xffl_like.run strategy.transport=mpi (or use strategy.transport=torch)"
        )


def mpi_communicator(state):
    """The ``mpi`` transport's communicator, after checking that MPI's ranks are the job's.
    Collective over the world (every rank builds its strategies at the same point)."""
    from ..comm import get_mpi

    MPI = get_mpi()
    world = MPI.COMM_WORLD
    mine = world.Get_size() == state.world_size and world.Get_rank() == state.rank
    # Every rank must take the same branch: agree before raising.
    if not world.allreduce(int(mine), op=MPI.MIN):
        raise ValueError(
            f"strategy.transport=mpi: MPI_COMM_WORLD has {world.Get_size()} process(es) but the job {state.world_size} "
            f"(or their ranks differ): start the job under the MPI launcher of the MPI library mpi4py uses"
        )
    return _private_world()


@functools.cache
def _private_world():
    # One duplicate of MPI_COMM_WORLD per process, shared by all strategies: their tags meet
    # no one else's messages, and a round completes before the next starts.
    from ..comm import get_mpi

    return get_mpi().COMM_WORLD.Dup()
