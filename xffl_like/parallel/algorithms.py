"""Bagua's interchangeable data-parallel algorithms, on any torch.distributed backend.

Each algorithm reacts to the events :class:`~xffl_like.parallel.bagua.BaguaModule`
reports: ``before_forward``, ``grad_ready(bucket)`` (in a fixed bucket order, during
backward), ``after_backward``, ``after_step`` (after ``optimizer.step()``). "Node"
and hierarchical modes are described in :mod:`xffl_like.parallel.runtime`.

Differences from Bagua, on purpose: low-precision decentralized compresses the
difference against the copy its neighbours hold (Bagua takes it against the
freshly averaged weights, so neighbours' copies never see the averaging and drift
from the weights they stand for); shift_one checks an even number of peers with a
``ValueError`` instead of an assertion inside the communication thread.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed.compat import all_gather_single
from . import codec
from .buckets import AlgorithmHost, Bucket
from .runtime import CommThread, NodeComm, node_channel, p2p_exchange
from .topology import background_group

__all__ = [
    "Algorithm",
    "GradientAllReduce",
    "ByteGrad",
    "Decentralized",
    "LowPrecisionDecentralized",
    "AsyncModelAverage",
    "shift_one_peer",
]

CHUNK_VALUES = 4096  # values per min-max chunk in low-precision gossip: 0.2% header overhead


class Algorithm:
    """Base class: one instance serves one module at a time (``attach`` ... ``detach``)."""

    hierarchical = False

    def attach(self, module: AlgorithmHost) -> None:
        """Start serving ``module`` (collective: all ranks, weights already identical)."""
        self.module = module
        self.comm = module.comm

    def detach(self) -> None:
        """Finish pending communication and stop (collective)."""

    def _drop_groups(self) -> None:
        """After ``detach`` at exit: forget the process groups (see BaguaModule._finish_at_exit)."""
        self.comm = None

    def before_forward(self) -> None:  # noqa: D102
        pass

    def grad_ready(self, bucket: Bucket) -> None:  # noqa: D102
        pass

    def after_backward(self) -> None:  # noqa: D102
        pass

    def before_step(self) -> None:  # noqa: D102
        pass

    def after_step(self) -> None:  # noqa: D102
        pass

    # members of the exchange: node leaders in hierarchical mode, everyone otherwise
    def _members(self) -> tuple[list[int], dist.ProcessGroup | None, bool]:
        c = self.comm
        if self.hierarchical:
            return list(c.leaders), c.leader_group, c.is_leader
        return list(range(c.world_size)), dist.group.WORLD, True

    def __repr__(self) -> str:
        keys = ", ".join(
            f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_") and k not in ("module", "comm")
        )
        return f"{type(self).__name__}({keys})"


class GradientAllReduce(Algorithm):
    """Sum (``average``: mean) the gradients of all ranks; ``hierarchical``: inside the node, among
    the node leaders, then broadcast inside the node. Bucket all-reduces overlap the backward pass."""

    def __init__(self, hierarchical: bool = False, average: bool = True):
        self.hierarchical, self.average = hierarchical, average

    def attach(self, module):
        super().attach(module)
        self._pending = []

    def _node_summed(self, bucket):
        """The bucket's flat gradients, pre-divided when averaging, summed inside the node when hierarchical."""
        flat = bucket.grads_flat()
        if self.average:
            flat.div_(self.comm.world_size)
        if self.hierarchical:
            self.comm.node_sum(flat)
        return flat

    def grad_ready(self, bucket):
        flat = self._node_summed(bucket)
        if self.hierarchical:
            work = None
            if self.comm.leader_group is not None:
                work = dist.all_reduce(flat, group=self.comm.leader_group, async_op=True)
        else:
            work = dist.all_reduce(flat, async_op=True)
        self._pending.append((bucket, flat, work))

    def after_backward(self):
        for bucket, flat, work in self._pending:
            if work is not None:
                work.wait()
            if self.hierarchical:
                self.comm.node_broadcast(flat)
            bucket.set_grads(flat)
        self._pending = []


class ByteGrad(GradientAllReduce):
    """Gradient all-reduce with 8-bit min-max compression (one chunk per member):
    compress -> all-to-all -> each member decompresses and averages its chunk ->
    recompress -> all-gather -> decompress. ``hierarchical``: full-precision sum
    to the node leader first, compressed exchange among node leaders, the result
    broadcast (compressed) inside the node.

    Overlapped with the backward pass, as DDP's bucket all-reduces are: when a bucket's
    gradients are ready its node reduce starts (asynchronously), and the rest of its chain
    runs beside backward; ``after_backward`` waits for the buckets in order and writes the
    decoded gradients. No second thread ever issues NCCL:

    - on CUDA the chain is issued by the training thread on a side stream of its own (NCCL
      collectives only enqueue work; the side stream first waits for the gradients, and the
      training stream waits for the side stream in ``after_backward``): nothing blocks the host;
    - elsewhere (host tensors) it runs on a communication thread
      (:class:`~xffl_like.parallel.runtime.CommThread`) over gloo groups of its own
      (:func:`~xffl_like.parallel.topology.background_group`: the members' exchange and the node
      broadcast), never the groups the training thread uses.
    """

    def __init__(self, hierarchical: bool = True, average: bool = True):
        super().__init__(hierarchical, average)

    def attach(self, module):
        super().attach(module)
        members, group, _ = self._members()
        self._thread, self._stream = None, None
        if module.device.type == "cuda":  # the training thread, a side stream, the members' groups
            self._stream = torch.cuda.Stream(device=module.device)
            self._group = group
            self._bcast_group = node_channel(self.comm, "bytegrad-broadcast") if self.hierarchical else None
        else:  # a communication thread, on gloo groups no one else uses
            self._group = background_group(members, "bytegrad-exchange")
            self._bcast_group = background_node_channel(self.comm, "bytegrad-broadcast") if self.hierarchical else None
            self._thread = CommThread("xffl-bytegrad")

    def detach(self):
        self._pending = []
        if self._thread is not None:
            self._thread.close()

    def _drop_groups(self):
        super()._drop_groups()
        self._group, self._bcast_group = None, None

    def grad_ready(self, bucket):
        flat = bucket.grads_flat()  # a copy: the gradients stay untouched until after_backward
        if self.average:
            flat.div_(self.comm.world_size)
        reduced = self.comm.node_reduce(flat, async_op=True) if self.hierarchical else None
        if self._thread is not None:
            self._pending.append((bucket, self._thread.submit(self._exchange, flat, reduced)))
            return
        # CUDA: enqueue the chain on the side stream, after the gradients (and the node reduce) are written
        self._stream.wait_stream(torch.cuda.current_stream(flat.device))
        # ``flat`` was allocated on the training stream and is dropped when this returns, while the side stream
        # still reads it: its block is not reused until the side stream's work queued so far is done
        flat.record_stream(self._stream)
        done: Future = Future()
        with torch.cuda.stream(self._stream):
            done.set_result(self._exchange(flat, reduced))
        self._pending.append((bucket, done))

    def after_backward(self):
        pending, self._pending = self._pending, []
        if self._stream is not None and pending:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        for bucket, future in pending:
            work, rows, numel = future.result()
            if work is not None:
                work.wait()
            if self._stream is not None:  # made on the side stream, read on this one: not reused before
                rows.record_stream(torch.cuda.current_stream(rows.device))
            bucket.set_grads(codec.decompress(rows, numel))

    def _exchange(self, flat: Tensor, reduced) -> tuple:
        """One bucket's chain (the communication thread's job, or enqueued on the side stream):
        ``(broadcast work or None, packed rows, numel)``."""
        numel = flat.numel()
        if reduced is not None:
            reduced.wait()
        members, _, member = self._members()
        group = self._group
        n = len(members)
        rows = None
        if member and n > 1:
            send = codec.compress(flat, n)
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            length = codec.chunk_length(numel, n)
            mine = codec.decompress(recv, n * length).view(n, length).sum(0)
            packed = codec.compress(mine, 1)
            rows = torch.empty((n,) + tuple(packed.shape[1:]), dtype=torch.uint8, device=packed.device)
            all_gather_single(rows, packed, group=group)
        elif member:  # a single member: its own sum, compressed once like the others would see it
            rows = codec.compress(flat, 1)
        work = None
        if self._bcast_group is not None:  # (the next bucket's exchange need not wait for it)
            if rows is None:
                rows = torch.empty((n, codec.packed_bytes(numel, n) // n), dtype=torch.uint8, device=flat.device)
            work = dist.broadcast(rows, self.comm.leader, group=self._bcast_group, async_op=True)
        return work, rows, numel


def background_node_channel(comm: NodeComm, channel: str) -> dist.ProcessGroup | None:
    """:func:`~.comm.node_channel` on gloo (:func:`~.topology.background_group`): this process's node,
    for a background thread's collectives (collective over the world: every process calls it, in one order)."""
    starts = [sum(comm.sizes[:i]) for i in range(len(comm.sizes))]
    groups = [
        background_group(range(start, start + size), channel) if size > 1 else None
        for start, size in zip(starts, comm.sizes)
    ]
    return groups[comm.node]


def shift_one_peer(rank: int, n: int, comm_step: int) -> int:
    """Bagua's shift_one partner of member ``rank`` among ``n`` (even) at communication step ``comm_step``:
    the first half pairs with the second half, shifted by one every step."""
    half = n // 2
    if rank < half:
        return (comm_step + rank) % half + half
    return (rank - half - comm_step) % half


class Decentralized(Algorithm):
    """Weight gossip (D-PSGD): at the forward pass the weights are sent to the peers (``all``:
    every member; ``shift_one``: one partner, changing every communication step); after the
    backward pass the weights become the average, and the optimizer applies the gradient
    (computed at the pre-average weights) to it. Communicates every ``communication_interval``
    iterations. ``hierarchical``: node means are exchanged among node leaders, weighted by
    node size (so nodes of unequal size keep the mean over all processes)."""

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all", communication_interval: int = 1):
        if peer_selection_mode not in ("all", "shift_one"):
            raise ValueError(f"peer_selection_mode must be 'all' or 'shift_one', got {peer_selection_mode!r}")
        if communication_interval < 1:
            raise ValueError(f"communication_interval must be >= 1, got {communication_interval}")
        self.hierarchical, self.peer_selection_mode = hierarchical, peer_selection_mode
        self.communication_interval = communication_interval

    def attach(self, module):
        super().attach(module)
        members, _, _ = self._members()
        if self.peer_selection_mode == "shift_one" and len(members) > 1 and len(members) % 2:
            what = "nodes" if self.hierarchical else "processes"
            raise ValueError(
                f"Decentralized(peer_selection_mode='shift_one') needs an even number of {what}, got "
                f"{len(members)}: use peer_selection_mode='all' or an even number of {what}"
            )
        self._step = 0
        self._pending = []

    def before_forward(self):
        if self._step % self.communication_interval:
            return
        members, group, member = self._members()
        n = len(members)
        for bucket in self.module.buckets:
            x = bucket.weights_flat()
            if self.hierarchical:
                self.comm.node_sum(x)
                x.div_(self.comm.local_world_size)
            works, peer_buf, weights = [], None, (1, 1)
            if member and n > 1:
                # Node means weighted by node size: with nodes of unequal size the mean over all
                # processes is kept (equal nodes: the plain mean of the members, as in Bagua).
                size = self.comm.local_world_size if self.hierarchical else 1
                if self.peer_selection_mode == "all":
                    x.mul_(size / self.comm.world_size if self.hierarchical else 1 / n)
                    works = [dist.all_reduce(x, group=group, async_op=True)]
                else:
                    me = members.index(self.comm.rank)
                    partner = shift_one_peer(me, n, self._step // self.communication_interval)
                    peer = members[partner]
                    weights = (size, self.comm.sizes[partner] if self.hierarchical else 1)
                    peer_buf = torch.empty_like(x)
                    works = p2p_exchange([(x, peer)], [(peer_buf, peer)])
            self._pending.append((bucket, x, works, peer_buf, weights))

    def after_backward(self):
        for bucket, x, works, peer_buf, (mine, theirs) in self._pending:
            for w in works:
                w.wait()
            if peer_buf is not None:
                x.mul_(mine).add_(peer_buf, alpha=theirs).div_(mine + theirs)
            if self.hierarchical:
                self.comm.node_broadcast(x)
            bucket.set_weights(x)
        self._pending = []
        self._step += 1

    def detach(self):
        for _, _, works, _, _ in self._pending:  # a forward without backward: let the exchange finish
            for w in works:
                w.wait()
        self._pending = []


class LowPrecisionDecentralized(Algorithm):
    """Ring gossip of 8-bit compressed weight differences (DCD-PSGD).

    Every member keeps its public weights ``x`` (what its neighbours hold of it) and
    copies of its left and right neighbours' public weights. After backward:
    ``x <- (x + left + right) / 3``; the optimizer steps; then the difference to the
    previous public weights is compressed (min-max uint8), sent to both neighbours,
    and every copy (own, left, right) adds the same decompressed difference, so each
    rank's weights equal its neighbours' copies of them exactly. ``hierarchical``: the
    node averages its differences and its leader gossips for it.
    """

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        if communication_interval < 1:
            raise ValueError(f"communication_interval must be >= 1, got {communication_interval}")
        self.hierarchical, self.communication_interval = hierarchical, communication_interval

    def attach(self, module):
        super().attach(module)
        self._step = 0
        self._public = [b.weights_flat() for b in module.buckets]
        self._left = [p.clone() for p in self._public]
        self._right = [p.clone() for p in self._public]

    def _communicates(self) -> bool:
        members, _, _ = self._members()
        return len(members) > 1 and self._step % self.communication_interval == 0

    def after_backward(self):
        if not self._communicates():
            return
        for bucket, left, right in zip(self.module.buckets, self._left, self._right):
            x = bucket.weights_flat()
            bucket.set_weights(x.add_(left).add_(right).div_(3))

    def after_step(self):
        if self._communicates():
            members, _, member = self._members()
            n = len(members)
            for bucket, public, left, right in zip(self.module.buckets, self._public, self._left, self._right):
                diff = bucket.weights_flat().sub_(public)
                if self.hierarchical:
                    self.comm.node_sum(diff)
                    diff.div_(self.comm.local_world_size)
                chunks = max(1, math.ceil(diff.numel() / CHUNK_VALUES))
                rows = torch.empty((3, codec.packed_bytes(diff.numel(), chunks)), dtype=torch.uint8, device=diff.device)
                if member:
                    me = members.index(self.comm.rank)
                    lpeer, rpeer = members[(me - 1) % n], members[(me + 1) % n]
                    rows[0] = codec.compress(diff, chunks).view(-1)
                    for w in p2p_exchange([(rows[0], lpeer), (rows[0], rpeer)], [(rows[1], lpeer), (rows[2], rpeer)]):
                        w.wait()
                if self.hierarchical:
                    self.comm.node_broadcast(rows)
                numel = diff.numel()
                public.add_(codec.decompress(rows[0].view(chunks, -1), numel))
                left.add_(codec.decompress(rows[1].view(chunks, -1), numel))
                right.add_(codec.decompress(rows[2].view(chunks, -1), numel))
                bucket.set_weights(public)
        self._step += 1

    @property
    def peer_copies(self) -> tuple[list[Tensor], list[Tensor]]:
        """This rank's copies of its left and right neighbours' weights, per bucket (for inspection)."""
        return self._left, self._right


class AsyncModelAverage(Algorithm):
    """Local steps, while a background thread averages the weights of all ranks every
    ``sync_interval_ms``; the first ``warmup_steps`` optimizer steps use synchronous gradient
    all-reduce instead.

    The thread snapshots the weights (never during ``optimizer.step()``), averages the
    snapshots over all ranks on its own process group, and adds ``avg - snapshot`` to the
    weights itself between iterations (after ``optimizer.step()``, before the next forward);
    during an iteration it leaves the result to the training thread, which adds it at the end
    of that ``optimizer.step()`` (the next forward may never come). So weights saved by
    autograd are never modified under a running backward, local steps taken during an
    exchange are kept, and the mean over ranks is unchanged.
    ``abort()`` stops the thread (every rank must call it; all ranks stop after the same
    exchange) and applies the last result; ``resume()`` starts it again.

    The thread never issues NCCL nor touches the training thread's stream: it averages host
    copies of the weights over a gloo group of its own
    (:func:`~xffl_like.parallel.topology.background_group`), so its stop flag's ``.item()`` and
    its all-reduces wait on the host only. On CUDA its snapshot is copied on a side stream that
    waits for the training stream's last write of the weights (an event), into pinned memory,
    while holding the lock (the next ``optimizer.step()`` waits for the copy, never the GPU for
    the thread); the training thread adds the result itself, before its next forward or at the
    end of its ``optimizer.step()`` (or at ``abort()``)."""

    def __init__(self, sync_interval_ms: int = 500, warmup_steps: int = 0):
        if sync_interval_ms < 0 or warmup_steps < 0:
            raise ValueError(f"sync_interval_ms and warmup_steps must be >= 0, got {sync_interval_ms}, {warmup_steps}")
        self.sync_interval_ms, self.warmup_steps = sync_interval_ms, warmup_steps
        self._thread: threading.Thread | None = None

    def attach(self, module):
        super().attach(module)
        self._steps = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._delta: list[Tensor] | None = None  # avg - snapshot, waiting for a safe point
        self._busy = False  # an iteration (forward .. optimizer.step) is running
        self._warmup = GradientAllReduce()
        self._warmup.attach(module)
        self.rounds = 0  # exchanges completed (for inspection)
        self._group = background_group(range(dist.get_world_size()), "async-model-average")
        self._cuda = module.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=module.device) if self._cuda else None
        self._written: torch.cuda.Event | None = None  # the training stream's last write of the weights
        self._mark_written()

    def _mark_written(self) -> None:
        """On CUDA: record where the training stream last wrote the weights (the thread's snapshot waits for it).
        Called after every write of the weights on the training stream, under the lock: the module's broadcast
        (``attach``), each optimizer step (``after_step``), each copy-back of an average (``_apply``, from
        ``before_forward`` and ``abort``) and any other write (:meth:`writing`)."""
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.module.device))
            self._written = event

    def grad_ready(self, bucket):
        if self._steps < self.warmup_steps:
            self._warmup.grad_ready(bucket)

    def after_backward(self):
        if self._steps < self.warmup_steps:
            self._warmup.after_backward()

    @contextlib.contextmanager
    def writing(self):
        """Around a write of the weights outside a training step (a checkpoint load, a reset), on the training
        thread: the background thread takes no snapshot during it, and its snapshot waits for the write on CUDA
        (``with algo.writing(): model.load_state_dict(sd)``)."""
        with self._lock:
            try:
                yield
            finally:
                self._mark_written()

    def before_forward(self):
        if self._error is not None:
            raise RuntimeError(f"asynchronous model averaging failed: {self._error}")
        with self._lock:
            self._apply()
            self._mark_written()  # also after any write since the last step that no writing() announced
            self._busy = True
        if self._steps >= self.warmup_steps and self._thread is None and not self._stop.is_set():
            self.resume()

    def before_step(self):
        self._lock.acquire()

    def after_step(self):
        # A result that arrived during this step: applied now. Left for the next forward, it waited for one that
        # may never come (after the last step), and the thread, which starts no exchange while one is pending,
        # held every rank's thread until abort.
        self._apply()
        self._mark_written()
        self._busy = False
        self._lock.release()
        self._steps += 1

    def resume(self) -> None:
        """Start (again) the background averaging thread (collective)."""
        if self._thread is not None:
            return
        self._stop.clear()
        group = self._group
        self._thread = threading.Thread(target=self._run, args=(group,), name="xffl-async-average", daemon=True)
        self._thread.start()

    def abort(self) -> None:
        """Stop the background thread after the exchange in progress and apply its result (collective)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._apply()

    def detach(self):
        self.abort()

    def _drop_groups(self):
        super()._drop_groups()
        self._warmup._drop_groups()
        self._group = None

    def _apply(self) -> None:  # under self._lock: the copy-back of an average, then its mark
        if self._delta is not None:
            for b, d in zip(self.module.buckets, self._delta):
                w = b.weights_flat()
                b.set_weights(w.add_(d.to(w.device, non_blocking=True)))
            self._delta = None
            self._mark_written()

    def _snapshot(self) -> list[Tensor]:  # under self._lock, on the thread: host copies of the weights
        buckets = self.module.buckets
        if not self._cuda:
            return [b.weights_flat() for b in buckets]
        stream = self._stream
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            stream.wait_event(self._written)
            snaps = []
            for b in buckets:
                w = b.weights_flat()
                snaps.append(torch.empty(w.shape, dtype=w.dtype, pin_memory=True).copy_(w, non_blocking=True))
        stream.synchronize()  # the side stream only: the host waits, no stream waits for this thread
        return snaps

    def _run(self, group):
        n = dist.get_world_size(group)
        try:
            while True:
                # Wait until the training thread applied the last result (or we are stopping), then
                # agree with every rank on whether to go on: all ranks run the same exchanges.
                while self._delta is not None and not self._stop.is_set():
                    time.sleep(0.001)
                flag = torch.tensor([1.0 if self._stop.is_set() else 0.0])  # a host tensor on a gloo group
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
                if flag.item() > 0:
                    break
                with self._lock:
                    snaps = self._snapshot()
                deltas = []
                for snap in snaps:
                    avg = torch.empty(snap.shape, dtype=snap.dtype, pin_memory=self._cuda).copy_(snap)
                    dist.all_reduce(avg, group=group)
                    deltas.append(avg.div_(n).sub_(snap))
                with self._lock:
                    self._delta = deltas
                    if not self._busy and not self._cuda:  # on CUDA the training thread adds it (its stream)
                        self._apply()
                self.rounds += 1
                time.sleep(self.sync_interval_ms / 1000)
        except BaseException as exc:  # noqa: BLE001 - surfaced on the training thread
            self._error = exc
