"""What the data-parallel algorithms run on: who talks to whom (the world, the node, the node leaders),
one communication thread (:class:`CommThread`), finishing communication at exit (:func:`close_at_exit`,
:func:`release_process_groups`) and small collectives (:func:`p2p_exchange`, :func:`consensus_distance`).

"Node" is a block of consecutive ranks (the processes sharing a host under torchrun,
or a facility in the main job); nodes may differ in size. Hierarchical algorithms
reduce inside the node, run among the node leaders (the first rank of every node),
then broadcast inside the node. Groups are created once, by every process in one order.

Every process knows only its own node's size (``LOCAL_WORLD_SIZE``), which may differ
between hosts, so :func:`node_sizes` gathers them and cuts the world into nodes the
same way on every rank: deriving the node layout locally (``world // local``) gave
ranks of differently sized nodes different leader sets, and the job hung in a
collective that only some ranks entered.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import itertools
import os
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.backends import handles_cpu
from . import topology as _topology
from .topology import edge_group

__all__ = [
    "CommThread",
    "NodeComm",
    "close_at_exit",
    "consensus_distance",
    "finish_communication",
    "flat_copy",
    "node_channel",
    "node_comm",
    "node_sizes",
    "p2p_exchange",
    "release_process_groups",
    "split_nodes",
    "unflatten_into",
    "wait_work",
]


@dataclass(frozen=True)
class NodeComm:
    """Ranks and groups of one process for node-hierarchical communication."""

    rank: int
    world_size: int
    local_world_size: int  # the size of this process's node
    node: int
    node_ranks: tuple[int, ...]
    leaders: tuple[int, ...]
    node_group: dist.ProcessGroup | None  # None when the node is this process alone
    leader_group: dist.ProcessGroup | None  # None on non-leaders or with one node
    sizes: tuple[int, ...] = ()  # every node's size, in node order

    @property
    def is_leader(self) -> bool:
        return self.rank == self.node_ranks[0]

    @property
    def leader(self) -> int:
        return self.node_ranks[0]

    def node_sum(self, t: Tensor) -> None:
        """Sum ``t`` over the node, in place."""
        if self.node_group is not None:
            dist.all_reduce(t, group=self.node_group)

    def node_reduce(self, t: Tensor, async_op: bool = False):
        """Sum ``t`` over the node into the leader's ``t`` (other ranks' ``t`` is left undefined);
        with ``async_op`` the work to wait on (``None`` when the node is this process alone)."""
        if self.node_group is not None:
            return dist.reduce(t, self.leader, group=self.node_group, async_op=async_op)
        return None

    def node_broadcast(self, t: Tensor) -> None:
        """Copy the leader's ``t`` to every process of the node."""
        if self.node_group is not None:
            dist.broadcast(t, self.leader, group=self.node_group)


class CommThread:
    """One background thread that runs communication jobs one at a time, in submission order.

    A job that chains blocking steps (reduce inside the node, compress, exchange,
    decompress, gather, broadcast) runs here, so the training thread's backward pass goes
    on meanwhile: torch kernels and collectives release the GIL. One thread and FIFO order
    give every rank the same sequence of collectives on every group, whatever the timing.
    After a job fails the later ones are skipped (they would enter collectives that peers
    may never join); every :meth:`submit` returns a ``Future`` whose ``result()`` raises.
    The thread stops at :meth:`close`, when this object is garbage-collected, or at exit.
    """

    def __init__(self, name: str = "xffl-comm"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # The thread holds the queue, not this object, so dropping the object stops it.
        self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=name, daemon=True)
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._jobs, self._thread, _EXIT_JOIN_S)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue ``fn(*args)``; its return value (or exception) arrives in the returned future."""
        if not self._thread.is_alive():
            raise RuntimeError("the communication thread was closed")
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def close(self, timeout: float | None = None) -> bool:
        """Run the queued jobs, then stop the thread (idempotent); with ``timeout``, wait at most that
        many seconds for it. Whether the thread has stopped."""
        self._finalizer.detach()
        _stop(self._jobs, self._thread, timeout)
        return not self._thread.is_alive()


_EXIT_JOIN_S = 10.0  # at exit or collection: a job stuck in a collective (a dead peer) must not hang the exit


def _stop(jobs: queue.SimpleQueue, thread: threading.Thread, timeout: float | None) -> None:
    if thread.is_alive():
        jobs.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout)


def _serve(jobs: queue.SimpleQueue) -> None:
    error: BaseException | None = None
    while (job := jobs.get()) is not None:
        future, fn, args = job
        job = None  # hold nothing of a finished job while idle (its tensors, its groups)
        if error is not None:
            future.set_exception(RuntimeError(f"skipped after an earlier communication job failed: {error}"))
        else:
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread by result()
                error = exc
                future.set_exception(exc)
        future = fn = args = None


# ---------------------------------------------------------------------------------------------------- at exit
# Why a process that simply returns must still finish its communication first. When a gloo worker
# thread finishes a collective it drops the work's references to its tensors; with torch's PyObject
# preservation, dropping the last C++ reference of a tensor that Python also holds decrefs its
# PyObject, which takes the GIL. Once the interpreter has begun finalizing, taking the GIL ends the
# thread (PyThread_exit_thread, a forced unwind) and the unwind through torch's noexcept destructors
# calls std::terminate: "terminate called without an active exception", SIGABRT, after the script's
# last line (gdb: runLoop -> ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil; see
# pytorch PR 179291). Any collective completed a few milliseconds before the end (global_avg's) is
# enough, and so is a Python daemon thread (CommThread) still inside one. Destroying a group is not
# enough either: gloo joins its worker threads only in the group's C++ destructor, i.e. when the last
# Python reference goes, which for a group held by a live object or a cache happens during teardown.
#
# So, while the interpreter is still whole (atexit, or the framework's workers before they return):
# every object that communicates finishes what it has in flight and stops its threads
# (finish_communication), then every process group is destroyed and the references this package
# keeps to groups are dropped, and garbage is collected, so that gloo joins its threads right then
# (release_process_groups). The hook below is registered when this module is imported, so it runs
# after the atexit handlers of a script that imports this package first (atexit runs in reverse
# order): a script's own ``atexit.register(dist.destroy_process_group)`` still finds its group.

_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # creation number -> object
_CREATED = itertools.count()
_USED = False  # whether an object ever registered: the exit hook does nothing in other processes


def close_at_exit(obj: Any) -> None:
    """Have ``obj._finish_at_exit(timeout)`` called at interpreter exit (or by :func:`finish_communication`)
    if ``obj`` is still alive then; held weakly. Objects are finished in creation order, the same on
    every rank. ``_finish_at_exit`` finishes the object's communication in flight, waiting at most
    ``timeout`` seconds, stops its threads, and drops its references to process groups."""
    global _USED
    _USED = True
    _OPEN[next(_CREATED)] = obj


def finish_communication(timeout: float | None = _EXIT_JOIN_S) -> bool:
    """Finish the communication of every live object registered with :func:`close_at_exit`, in
    creation order (idempotent). A failure is reported in one line on stderr, not raised (this runs
    on the way out); whether every object finished cleanly."""
    clean = True
    for key in sorted(_OPEN.keys()):
        obj = _OPEN.pop(key, None)
        if obj is None:
            continue
        try:
            obj._finish_at_exit(timeout)
        except Exception as exc:  # noqa: BLE001 - on the way out: one line, then the other objects
            clean = False
            print(
                f"warning: {type(obj).__name__} could not finish its communication at exit: "
                f"{type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
        obj = None
    return clean


def release_process_groups() -> None:
    """Destroy every process group if the default one still exists, drop this package's cached
    references to groups (:func:`~.topology.edge_group`'s), then collect garbage: each gloo group
    whose last reference goes joins its worker threads now, while they can still take the GIL
    (see the note above). Call it once this process is done communicating; idempotent."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _OPEN.clear()  # nothing is left to finish once the groups are gone (not finished: a failing job)
    _topology._GROUPS.clear()
    gc.collect()  # groups held in reference cycles (a module and its hooks, a trainer) go now


def _at_exit() -> None:
    if _USED:
        finish_communication()
        release_process_groups()


atexit.register(_at_exit)


def wait_work(work: Any, timeout: float | None = None) -> None:
    """Wait for a collective's ``work`` (or anything with ``wait(timeout)`` in seconds), at most
    ``timeout`` seconds when given (then raises)."""
    if timeout is None:
        work.wait()
    elif isinstance(work, dist.Work):
        work.wait(datetime.timedelta(seconds=timeout))
    else:
        work.wait(timeout)


def split_nodes(declared: list[int]) -> tuple[int, ...]:
    """Node sizes from what every rank declares as its own node's size (pure).

    Nodes are consecutive blocks: the first ``declared[0]`` ranks form node 0, and so on;
    every rank of a block must declare the block's size. Raises ``ValueError`` naming the
    first rank that does not fit.
    """
    sizes, start = [], 0
    while start < len(declared):
        size = declared[start]
        block = declared[start : start + size]
        if size < 1 or len(block) < size or any(d != size for d in block):
            raise ValueError(
                f"processes per node {declared} (LOCAL_WORLD_SIZE of ranks 0..{len(declared) - 1}) do not cut the "
                f"world into consecutive nodes: rank {start} starts a node of {size} but ranks "
                f"{start}..{start + size - 1} do not all declare {size}; start the same number of processes on "
                f"every rank of a node, with consecutive ranks per node"
            )
        sizes.append(size)
        start += size
    return tuple(sizes)


def node_sizes(local_world_size: int | None = None) -> tuple[int, ...]:
    """Every node's size, agreed by all ranks (collective: every process calls it).

    ``local_world_size`` is this process's own node size (default ``LOCAL_WORLD_SIZE``, else
    the whole world); nodes may differ. Every rank raises the same ``ValueError`` when the
    declared sizes do not form consecutive nodes.
    """
    world = dist.get_world_size()
    local = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", world))
    mine = torch.tensor([local], dtype=torch.int64)
    if not handles_cpu():  # nccl alone (a cpu:gloo,cuda:nccl world takes the CPU tensor)
        mine = mine.cuda()
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    return split_nodes([int(t) for t in everyone])


def node_channel(comm: NodeComm, channel: str) -> dist.ProcessGroup | None:
    """A second group over this process's node, for collectives issued from another thread than
    the node group's (collective over the world: every process calls it, in one order)."""
    starts = [sum(comm.sizes[:i]) for i in range(len(comm.sizes))]
    groups = [
        edge_group(range(start, start + size), channel) if size > 1 else None for start, size in zip(starts, comm.sizes)
    ]
    return groups[comm.node]


def node_comm(local_world_size: int | None = None) -> NodeComm:
    """Build this process's :class:`NodeComm` (collective over the world: every process calls it).

    ``local_world_size`` (default ``LOCAL_WORLD_SIZE``) is the size of this process's node;
    nodes may differ in size (see :func:`node_sizes`).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = node_sizes(local_world_size)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    node = max(i for i, s in enumerate(starts) if s <= rank)
    node_ranks = tuple(range(starts[node], starts[node] + sizes[node]))
    leaders = tuple(starts)
    # Every rank creates every group, in one order (node by node, then the leaders): see edge_group.
    groups = [edge_group(range(start, start + size)) if size > 1 else None for start, size in zip(starts, sizes)]
    node_group = groups[node]
    leader_group = edge_group(leaders) if len(leaders) > 1 else None
    return NodeComm(rank, world, len(node_ranks), node, node_ranks, leaders, node_group, leader_group, sizes)


def p2p_exchange(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> list:
    """Post sends and receives together (no ordering deadlock); returns the works to wait on.

    Receives first: gloo sends a message only once its receiver has announced the receive, and
    that notice queues behind whatever this rank already sent to the peer (see
    ``aggregation.executor._exchanges``); on NCCL the batch is one group, where order is free."""
    ops = [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    ops += [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    return dist.batch_isend_irecv(ops) if ops else []


def flat_copy(tensors: list[Tensor], out: Tensor | None = None) -> Tensor:
    """Concatenate ``tensors`` into one flat buffer (reused when ``out`` is given)."""
    if out is None:
        return torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return out


def unflatten_into(flat: Tensor, tensors: list[Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``."""
    offset = 0
    for t in tensors:
        t.detach().copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


CONSENSUS_CHUNK = 1 << 22  # values per all-reduce of consensus_distance: 16 MiB of fp32


@torch.no_grad()
def consensus_distance(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> float:
    """Mean over the ranks of ``group`` (default: the world) of the L2 distance between this
    rank's parameters and their average over the ranks (collective; 0 when all copies agree).

    Chunk by chunk of ``CONSENSUS_CHUNK`` values in float32 (wider dtypes keep theirs), the squared
    distance summed in float64: no whole-model copy, and no float64 all-reduce of the model."""
    params = [p.detach().reshape(-1) for p in module.parameters()]
    if not params:
        return 0.0
    n = dist.get_world_size(group)
    squared = torch.zeros(1, dtype=torch.float64, device=params[0].device)
    for p in params:
        wide = torch.float64 if p.dtype == torch.float64 else torch.float32
        for piece in p.split(CONSENSUS_CHUNK):
            mine = piece.to(wide, copy=True)
            mean = mine.clone()
            dist.all_reduce(mean, group=group)
            squared += (mine - mean.div_(n)).double().square().sum()
    distance = squared.sqrt_()
    dist.all_reduce(distance, group=group)
    return float(distance) / n
