"""Run a :class:`~.strategy.Strategy`: the weighted mean of the parameters across facilities.

Each round, for every communication of the plan, in plan order:

1. owners pack their contribution (pre-scaled by ``w_f / sum(w)`` unless NCCL scales in
   the reduction) and start the cross-facility all-reduce asynchronously, on the group
   of the communication's chunk and stream;
2. in the same order, owners wait for their reduction, start the broadcast of the result
   to the other replicas of the facility (when there are any) and unpack into the
   parameters, while the others start receiving;
3. receivers wait and unpack.

Streams are separate process groups: on CPU their collectives run concurrently in gloo's
threads; on CUDA each communication's packing, collective and unpacking is issued on its
own CUDA stream. Packing of one communication overlaps the collectives already in flight.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from .reference import facility_scale
from .strategy import Communication, Strategy

__all__ = ["AggregationResult", "aggregate"]


@dataclass(frozen=True)
class AggregationResult:
    """One round's numbers. ``bytes_per_rank``: bytes this rank contributed to cross-facility
    reductions; ``cross_facility_bytes``: bytes all facilities sent across their boundary."""

    seconds: float
    bytes_per_rank: int
    cross_facility_bytes: int


# ----------------------------------------------------------------------------- packing
def _pack(comm: Communication, packing: str, scale: float | None, receive: bool):
    """The tensor (or list) that travels for ``comm``; receivers get uninitialised storage."""
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


def _unpack(comm: Communication, packing: str, wire) -> None:
    if packing in ("inplace", "coalesced"):
        return
    if packing == "stack":
        torch._foreach_copy_(list(comm.tensors), list(wire.unbind(0)))
    else:
        torch._foreach_copy_([t.view(-1) for t in comm.tensors], list(_split(wire, comm)))


# ----------------------------------------------------------------------------- collectives
def _all_reduce(wire, group, op):
    if isinstance(wire, list):
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for t in wire:
                dist.all_reduce(t, op=op, group=group)
        return cm
    return dist.all_reduce(wire, op=op, group=group, async_op=True)


def _broadcast(wire, src: int, group):
    if isinstance(wire, list):
        with dist._coalescing_manager(group=group, async_ops=True) as cm:
            for t in wire:
                dist.broadcast(t, src=src, group=group)
        return cm
    return dist.broadcast(wire, src=src, group=group, async_op=True)


def _reduce_op(strategy: Strategy, scale: float, uniform: bool):
    """(op, pre-scale): gloo sums pre-scaled contributions; NCCL averages / pre-multiplies."""
    if strategy.reduce_op == "premul_sum":
        if uniform:
            return dist.ReduceOp.AVG, None
        return dist._make_nccl_premul_sum(scale), None
    return dist.ReduceOp.SUM, scale


def _peer_groups(strategy: Strategy, state) -> dict[int, tuple]:
    exchanges = state.split_exchanges if strategy.mode == "split" else state.sender_exchanges
    return {pe.exchange.chunk: pe.groups for pe in exchanges}


# ----------------------------------------------------------------------------- aggregate
@torch.no_grad()
def aggregate(strategy: Strategy, state, weights: Sequence[float] | None = None) -> AggregationResult:
    """Replace the strategy's parameters, on every rank, by their weighted mean over facilities.

    ``weights`` (one per facility, non-negative, positive sum) default to uniform. The
    parameters stay the model's own tensors. Returns the round's seconds and byte counts.
    """
    start = time.perf_counter()
    scale = facility_scale(state, weights)  # validates weights
    comms = strategy.communications
    if not comms:
        return AggregationResult(time.perf_counter() - start, 0, strategy.cross_facility_bytes)
    uniform = weights is None or len(set(float(w) for w in weights)) == 1
    op, prescale = _reduce_op(strategy, scale, uniform)
    packing = strategy.packing
    peers = _peer_groups(strategy, state)
    streams = state.streams
    if streams:
        current = torch.cuda.current_stream()
        for s in streams[: strategy.num_streams]:
            s.wait_stream(current)

    def on(comm):
        return torch.cuda.stream(streams[comm.stream]) if streams else contextlib.nullcontext()

    # 1. owners: pack and start the cross-facility reductions.
    reductions = {}
    for k, comm in enumerate(comms):
        if comm.reduce:
            with on(comm):
                wire = _pack(comm, packing, prescale, receive=False)
                reductions[k] = (wire, _all_reduce(wire, peers[comm.chunk][comm.stream], op))

    # 2. in plan order: owners finish and forward, the other replicas start receiving.
    receiving = []
    broadcasts = []
    for k, comm in enumerate(comms):
        with on(comm):
            group = state.replica_groups[comm.stream]
            if comm.reduce:
                wire, work = reductions.pop(k)
                work.wait()
                if comm.broadcast:
                    broadcasts.append(_broadcast(wire, comm.source, group))
                _unpack(comm, packing, wire)
            else:
                wire = _pack(comm, packing, None, receive=True)
                receiving.append((comm, wire, _broadcast(wire, comm.source, group)))

    # 3. receivers unpack; senders make sure their broadcasts are done before buffers are reused.
    for comm, wire, work in receiving:
        with on(comm):
            work.wait()
            _unpack(comm, packing, wire)
    for work in broadcasts:
        work.wait()
    if streams:
        current = torch.cuda.current_stream()
        for s in streams[: strategy.num_streams]:
            current.wait_stream(s)
        current.synchronize()
    return AggregationResult(time.perf_counter() - start, strategy.bytes_per_rank, strategy.cross_facility_bytes)
