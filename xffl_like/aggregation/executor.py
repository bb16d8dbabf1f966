"""Run a :class:`~.strategy.Strategy`: the weighted mean of the parameters across facilities.

Each round, for every communication of the plan, in plan order:

1. owners pack their contribution and start the cross-facility reduction asynchronously
   on the group of the communication's chunk and stream: the *exchange* (gloo's default:
   point-to-point reduce-scatter + all-gather, the weights applied in the reduction) or the
   backend's all-reduce (AVG for uniform weights; otherwise NCCL's PREMUL_SUM, or a SUM of
   contributions pre-scaled by ``w_f / sum(w)``);
2. in the same order, owners wait for their reduction, start broadcasting the result to
   the other replicas of the facility (when there are any) and unpack it into the
   parameters, while the other replicas start receiving;
3. receivers wait and unpack.

With ``strategy.transport=mpi`` step 1 is always the exchange, its messages carried by
:mod:`xffl_like.comm`'s MPI backend; steps 2 and 3 (inside the facility) stay on torch.

Streams are separate process groups: on CPU their collectives run concurrently in gloo's
threads; on CUDA each communication's packing, collective and unpacking is issued on its
own CUDA stream. Packing of one communication overlaps the collectives already in flight.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..comm import transport
from .strategy import Communication, Strategy, parts

__all__ = ["AggregationResult", "aggregate", "facility_scale"]


@dataclass(frozen=True)
class AggregationResult:
    """One round's numbers. ``bytes_per_rank``: bytes this rank contributed to cross-facility
    reductions; ``cross_facility_bytes``: bytes all facilities sent across their boundary."""

    seconds: float
    bytes_per_rank: int
    cross_facility_bytes: int


def facility_scale(state, weights: Sequence[float] | None) -> float:
    """This facility's share of the mean, ``w_f / sum(w)``; rejects unusable weights."""
    if weights is None:
        return 1.0 / state.num_facilities
    if len(weights) != state.num_facilities or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(
            f"need {state.num_facilities} non-negative facility weights with a positive sum, got {list(weights)}"
        )
    return float(weights[state.facility]) / float(sum(weights))


# ----------------------------------------------------------------------------- packing
def _pack(comm: Communication, scale: float | None, receive: bool, packing: str):
    """The tensor (or list) that travels for ``comm`` packed as ``packing``; receivers get
    uninitialised storage."""
    ts = comm.tensors
    if packing == "inplace":
        wire = ts[0]
        if scale is not None and not receive:
            wire.mul_(scale)
        return wire
    if packing == "coalesced":
        wire = list(ts)
        if scale is not None and not receive:
            for t in wire:  # not _foreach_mul_: it rounds the scalar to bf16 first
                t.mul_(scale)
        return wire
    if packing == "persistent":
        wire = comm.buffer
        if not receive:
            for t, dst in zip(ts, _split(wire, comm)):
                if scale is None:
                    dst.copy_(t.view(-1))
                else:
                    torch.mul(t.view(-1), scale, out=dst)
        return wire
    if receive:
        if packing == "stack":
            return torch.empty((len(ts), *comm.shapes[0]), dtype=comm.dtype, device=ts[0].device)
        return torch.empty(comm.numel, dtype=comm.dtype, device=ts[0].device)
    wire = torch.stack(ts) if packing == "stack" else torch.cat([t.view(-1) for t in ts])
    if scale is not None:
        wire.mul_(scale)
    return wire


def _split(wire: torch.Tensor, comm: Communication):
    return wire.split([stop - start for _, start, stop in comm.spans])


def _unpack(comm: Communication, wire, packing: str) -> None:
    if packing in ("inplace", "coalesced"):
        return
    if packing == "stack":
        torch._foreach_copy_(list(comm.tensors), list(wire.unbind(0)))
    else:
        torch._foreach_copy_([t.view(-1) for t in comm.tensors], list(_split(wire, comm)))


# ----------------------------------------------------------------------------- collectives
class _AllReduce:
    """The backend's all-reduce (a list goes through the coalescing manager)."""

    def __init__(self, wire, group, op):
        if isinstance(wire, list):
            with dist._coalescing_manager(group=group, async_ops=True) as cm:
                for t in wire:
                    dist.all_reduce(t, op=op, group=group)
            self.work = cm
        else:
            self.work = dist.all_reduce(wire, op=op, group=group, async_op=True)

    def step(self) -> None:
        pass

    def wait(self) -> None:
        self.work.wait()


class _TorchLinks:
    """Point-to-point messages among the peers over their torch process group."""

    def __init__(self, group, ranks):
        order = sorted(ranks)  # group ranks follow the sorted global ranks
        self.group, self.group_ranks = group, [order.index(r) for r in ranks]

    def isend(self, t, j, tag):
        return dist.isend(t, group=self.group, tag=tag, group_dst=self.group_ranks[j])

    def irecv(self, t, j, tag):
        return dist.irecv(t, group=self.group, tag=tag, group_src=self.group_ranks[j])


class _MpiLinks:
    """The same messages through :mod:`xffl_like.comm`'s MPI backend (``strategy.transport=mpi``):
    one MPI message each, raw bytes, staged through host memory for device tensors."""

    def __init__(self, comm, ranks):
        self.comm, self.ranks = comm, ranks  # the strategy's duplicate of MPI_COMM_WORLD: global ranks

    def isend(self, t, j, tag):
        return transport.isend(t, self.ranks[j], backend="mpi", tag=tag, group=self.comm)

    def irecv(self, t, j, tag):
        return transport.irecv_into(t, self.ranks[j], backend="mpi", tag=tag, group=self.comm)


class _Exchange:
    """Reduce-scatter, then all-gather, of one flat tensor among the peers (one rank per
    facility, in facility order) by point-to-point messages over ``links``.

    Peer ``j`` receives part ``j`` from every other peer into ``scratch``, forms the weighted
    mean of it in place (the scaling fused into the reduction: no extra pass over the data)
    and sends it back. On gloo this is one message per peer and phase where the ring
    all-reduce synchronises per segment, and it needs neither AVG nor a pre-scale. The
    arithmetic is the same whatever carries the messages, so both transports agree bitwise.

    Construction posts only the receives of the parts this rank reduces; :meth:`start` posts
    the rest once the data is packed. The executor constructs every exchange of a round
    before starting any (see :func:`aggregate`).
    """

    def __init__(self, numel, scratch, links, num_peers, me, scales, tag):
        self.links, self.me, self.scales, self.tag = links, me, scales, tag
        self.num_peers, self.numel = num_peers, numel
        self.peers = [j for j in range(num_peers) if j != me]
        start, stop = parts(numel, num_peers)[me]
        mine = stop - start
        self.received = list(scratch[: mine * len(self.peers)].split(mine)) if mine else [scratch[:0]] * len(self.peers)
        self.arriving = [self._recv(t, j, 0) for t, j in zip(self.received, self.peers)]
        self.parts = self.scattered = self.results = self.gathered = None

    def start(self, flat) -> _Exchange:
        """Send this rank's parts of ``flat`` (``numel`` elements) to their reducers."""
        assert flat.numel() == self.numel, (flat.numel(), self.numel)
        self.parts = [flat[a:b] for a, b in parts(self.numel, self.num_peers)]
        # Posted before the sends, so that the notice "ready to receive" leaves ahead of this
        # rank's own data to that peer; and now although part j is still being sent: peer j
        # sends its result only after it has received part j from everyone.
        self.results = [self._recv(self.parts[j], j, 1) for j in self.peers]
        self.scattered = [self._send(self.parts[j], j, 0) for j in self.peers]
        return self

    def _send(self, t, j, phase):
        return self.links.isend(t, j, 2 * self.tag + phase) if t.numel() else None

    def _recv(self, t, j, phase):
        return self.links.irecv(t, j, 2 * self.tag + phase) if t.numel() else None

    def step(self) -> None:
        """Reduce my part once it has arrived, then start sending it back."""
        if self.gathered is not None:
            return
        _wait(self.arriving)
        mine, scales = self.parts[self.me], self.scales
        if mine.numel():
            if len(self.parts) == 2:  # (1 - s) * mine + s * theirs, in one pass
                torch.lerp(mine, self.received[0], scales[self.peers[0]], out=mine)
            else:
                mine.mul_(scales[self.me])
                for t, j in zip(self.received, self.peers):
                    mine.add_(t, alpha=scales[j])
        self.gathered = [self._send(mine, j, 1) for j in self.peers]

    def wait(self) -> None:
        self.step()
        _wait(self.scattered + self.results + self.gathered)


def _wait(works) -> None:
    for work in works:
        if work is not None:
            work.wait()


def _broadcast(wire, src: int, group):
    if isinstance(wire, list):
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for t in wire:
                dist.broadcast(t, src=src, group=group)
        return cm
    return dist.broadcast(wire, src=src, group=group, async_op=True)


def _reduce_op(strategy: Strategy, scale: float, uniform: bool):
    """(op, pre-scale or None) for all-reduces: see :attr:`Strategy.reduce_op`. Exactly one
    rank per facility joins each reduction, so AVG divides by the number of facilities."""
    if uniform and strategy.reduce_op in ("avg", "premul_sum"):
        return dist.ReduceOp.AVG, None
    if strategy.reduce_op == "premul_sum":
        return dist._make_nccl_premul_sum(scale), None
    return dist.ReduceOp.SUM, scale


def _exchanges(strategy: Strategy, comms, peers: dict, scales, me: int) -> dict[int, _Exchange]:
    """The round's exchanges (communication index -> exchange), their receives posted.

    Posted for every communication before any data is sent. gloo sends a message only once
    the receiver has announced the receive, and that notice travels on the same connection,
    in order, behind whatever this rank has queued to that peer already: announced after
    the first bucket's data, it would keep the peer's uplink idle while that bucket crosses
    (measured: one facility silent for the first ~0.25 s of a 1000 Mbit/s round)."""
    out = {}
    for k, comm in enumerate(comms):
        packing = _wire_packing(strategy, comm)
        if not comm.reduce or (
            strategy.transport != "mpi" and (strategy.collective != "exchange" or packing == "coalesced")
        ):
            continue
        peer = peers[comm.chunk]
        ranks = peer.exchange.ranks
        links = (
            _MpiLinks(strategy.mpi_comm, ranks)
            if strategy.transport == "mpi"
            else _TorchLinks(peer.groups[comm.stream], ranks)
        )
        out[k] = _Exchange(comm.numel, comm.scratch, links, len(ranks), me, scales, k)
    return out


def _wire_packing(strategy: Strategy, comm: Communication) -> str:
    """How ``comm`` travels this round: over MPI a coalesced list travels flattened (MPI has
    no coalesced collectives; the exchange needs one flat tensor)."""
    if strategy.transport == "mpi" and comm.packing == "coalesced":
        return "flatten"
    return comm.packing


def _peer_exchanges(strategy: Strategy, state) -> dict:
    exchanges = state.split_exchanges if strategy.mode == "split" else state.sender_exchanges
    return {pe.exchange.chunk: pe for pe in exchanges}


# ----------------------------------------------------------------------------- aggregate
@torch.no_grad()
def _on(streams, comm):
    """The context in which ``comm``'s work runs: its CUDA stream, or nothing on CPU."""
    return torch.cuda.stream(streams[comm.stream]) if streams else contextlib.nullcontext()


def _start_reductions(strategy: Strategy, state, peers: dict, scales, op, prescale) -> dict:
    """Owners post every exchange's receives, then pack and start the cross-facility reductions; each
    exchange then reduces what arrived and sends it back. Returns ``{plan index: (wire, work)}``."""
    comms, streams = strategy.communications, state.streams
    exchanges = _exchanges(strategy, comms, peers, scales, state.facility)
    reductions = {}
    for k, comm in enumerate(comms):
        if comm.reduce:
            with _on(streams, comm):
                exchange = exchanges.get(k)
                # an exchange applies the weights itself
                wire = _pack(comm, None if exchange else prescale, False, _wire_packing(strategy, comm))
                work = (
                    exchange.start(wire.view(-1))
                    if exchange
                    else _AllReduce(wire, peers[comm.chunk].groups[comm.stream], op)
                )
                reductions[k] = (wire, work)
    for k, (_, work) in reductions.items():  # exchanges: reduce what arrived, send it back
        with _on(streams, comms[k]):
            work.step()
    return reductions


def _finish_and_forward(strategy: Strategy, state, reductions: dict) -> tuple[list, list]:
    """In plan order: owners finish and forward, the other replicas start receiving.
    Returns the receives ``(comm, wire, work)`` and the owners' broadcasts."""
    receiving, broadcasts = [], []
    for k, comm in enumerate(strategy.communications):
        with _on(state.streams, comm):
            group = state.group("replica", comm.stream)
            if comm.reduce:
                wire, work = reductions.pop(k)
                work.wait()
                if comm.broadcast:
                    broadcasts.append(_broadcast(wire, comm.source, group))
                _unpack(comm, wire, _wire_packing(strategy, comm))
            else:
                wire = _pack(comm, None, True, _wire_packing(strategy, comm))
                receiving.append((comm, wire, _broadcast(wire, comm.source, group)))
    return receiving, broadcasts


def aggregate(strategy: Strategy, state, weights: Sequence[float] | None = None) -> AggregationResult:
    """Replace the strategy's parameters, on every rank, by their weighted mean over facilities.

    ``weights`` (one per facility, non-negative, positive sum) default to uniform. The
    parameters stay the model's own tensors. Returns the round's seconds and byte counts.
    """
    start = time.perf_counter()
    scale = facility_scale(state, weights)  # validates weights
    if not strategy.communications:
        return AggregationResult(time.perf_counter() - start, 0, strategy.cross_facility_bytes)
    uniform = weights is None or len(set(float(w) for w in weights)) == 1
    op, prescale = _reduce_op(strategy, scale, uniform)
    n = state.num_facilities
    scales = [1.0 / n] * n if weights is None else [float(w) / float(sum(weights)) for w in weights]
    peers = _peer_exchanges(strategy, state)
    streams = state.streams
    if streams:
        current = torch.cuda.current_stream()
        for s in streams[: strategy.num_streams]:
            s.wait_stream(current)
    # 1. owners start the cross-facility reductions; 2. they finish and forward, the others start receiving.
    reductions = _start_reductions(strategy, state, peers, scales, op, prescale)
    receiving, broadcasts = _finish_and_forward(strategy, state, reductions)
    # 3. receivers unpack; senders make sure their broadcasts are done before buffers are reused.
    for comm, wire, work in receiving:
        with _on(streams, comm):
            work.wait()
            _unpack(comm, wire, _wire_packing(strategy, comm))
    for work in broadcasts:
        work.wait()
    if streams:
        current = torch.cuda.current_stream()
        for s in streams[: strategy.num_streams]:
            current.wait_stream(s)
        current.synchronize()
    return AggregationResult(time.perf_counter() - start, strategy.bytes_per_rank, strategy.cross_facility_bytes)
