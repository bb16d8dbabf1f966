"""Build a rank's :class:`~.strategy.Strategy` from the model and the ``strategy`` section.

The pieces live by concern: :mod:`.planners` cuts the shard's data into collectives (pure),
:mod:`.options` checks the section and selects parameters, :mod:`.backend` sets up the reduce
op and the ``mpi`` transport. Here they are put together once per rank after ``fully_shard``.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config.schema import StrategyConfig
from .backend import check_collective, mpi_communicator, reduce_op
from .options import normalise_strategy, select_parameters
from .planners import BUILDERS, Segment, adjacent, cut_chunks, local_shard, span_view
from .strategy import COLLECTIVES, Communication, Strategy, parts

__all__ = ["build_strategy"]


def build_strategy(model: nn.Module, state, options: StrategyConfig, *, collective: str | None = None) -> Strategy:
    """Plan the aggregation of ``model`` (already FSDP-wrapped) for this rank.

    Call once on every rank after ``fully_shard`` and reuse the result every round.
    ``state`` is the worker's :class:`~xffl_like.distributed.state.DistributedState`;
    ``options`` the job's ``strategy`` section. ``collective`` (see :attr:`Strategy.collective`)
    defaults to ``exchange`` on gloo and ``all_reduce`` elsewhere.

    ``options`` is taken as validated (:func:`~.options.validate_strategy_options`, which the launcher
    runs once); only what depends on this rank's backend and state is checked here.
    """
    if not isinstance(options, StrategyConfig):
        raise TypeError(f"build_strategy takes the strategy section as a StrategyConfig, got {type(options).__name__}")
    opts = normalise_strategy(options)
    collective = _collective(opts, state, collective)
    named = list(model.named_parameters())
    selected = select_parameters(model, opts.only)
    locals_ = _local_shards(named, selected)
    model_bytes = sum(named[i][1].numel() * named[i][1].element_size() for i in selected)
    num_chunks = state.layout.num_chunks if opts.mode == "split" else 1
    return Strategy(
        name=opts.name,
        mode=opts.mode,
        num_streams=opts.streams,
        bucket_mb=opts.bucket_mb,
        packing=BUILDERS[opts.name].packing,
        collective=collective,
        reduce_op=reduce_op(state.backend),
        num_facilities=state.num_facilities,
        num_chunks=num_chunks,
        param_names=tuple(n for n, _ in named),
        selected=selected,
        model_bytes=model_bytes,
        communications=_communications(opts, state, locals_, num_chunks, collective),
        transport=opts.transport,
        mpi_comm=mpi_communicator(state) if opts.transport == "mpi" and state.num_facilities > 1 else None,
    )


def _collective(opts: StrategyConfig, state, collective: str | None) -> str:
    """The collective this rank's aggregation runs (``collective`` checked against the transport, the
    backend and the state's streams; ``None``: the exchange on gloo or over MPI, else the all-reduce)."""
    if opts.transport == "mpi":  # MPI carries the exchange's messages; there is no MPI all-reduce path
        if collective not in (None, "exchange"):
            raise ValueError(
                f"collective={collective!r} with strategy.transport=mpi: the mpi transport runs the exchange"
            )
        collective = "exchange"
    if collective is None:
        collective = "exchange" if state.backend == "gloo" else "all_reduce"
    if collective not in COLLECTIVES:
        raise ValueError(f"collective={collective!r}: valid collectives are {list(COLLECTIVES)}")
    if opts.transport == "torch":  # over MPI the exchange's messages bypass NCCL (host staging)
        check_collective(collective, state.backend)
    if opts.streams > state.num_streams:
        raise ValueError(
            f"strategy.streams={opts.streams} but the DistributedState has {state.num_streams} stream(s): "
            f"build the state with num_streams={opts.streams}"
        )
    return collective


def _local_shards(named: list, selected) -> list[tuple[int, torch.Tensor]]:
    """``(index, this rank's local shard)`` of every selected parameter, each contiguous (aggregated in place)."""
    locals_ = [(i, local_shard(named[i][1])) for i in selected]
    for i, local in locals_:
        if not local.is_contiguous():
            raise ValueError(
                f"parameter {named[i][0]!r} has a non-contiguous local shard: cannot aggregate it in place"
            )
    return locals_


def _communications(opts: StrategyConfig, state, locals_, num_chunks: int, collective: str) -> tuple:
    """Every communication of this rank's round, chunk by chunk (none with a single facility)."""
    if state.num_facilities == 1:
        return ()
    layout, facility, replica = state.layout, state.facility, state.replica
    split = opts.mode == "split"
    builder = BUILDERS[opts.name]
    cap = max(1, int(opts.bucket_mb * 2**20))
    communications: list[Communication] = []
    for c, segments in enumerate(cut_chunks(locals_, num_chunks)):
        owner = layout.chunk_owner(facility, c) if split else 0
        for group, stream in builder.plan(segments, opts.streams, cap):
            communications.append(
                _communication(
                    group,
                    stream,
                    c,
                    owner,
                    layout.rank_of(facility, owner, state.shard),
                    owner == replica,
                    state.num_replicas > 1,
                    builder.packing,
                    collective,
                    facility,
                    state.num_facilities,
                    opts.transport,
                )
            )
    return tuple(communications)


def _communication(
    group: list[Segment],
    stream: int,
    chunk: int,
    owner: int,
    source: int,
    reduce: bool,
    broadcast: bool,
    packing: str,
    collective: str,
    facility: int,
    num_facilities: int,
    transport: str = "torch",
) -> Communication:
    tensors = tuple(s.tensor for s in group)
    device = group[0].tensor.device
    numel = sum(s.stop - s.start for s in group)
    buffer = scratch = None
    if packing == "persistent" and adjacent(tensors):
        packing = "inplace"  # one contiguous view: nothing to stage
        tensors = (span_view(tensors),) if len(tensors) > 1 else tensors
    if packing == "persistent":
        buffer = torch.empty(numel, dtype=group[0].dtype, device=device)
    # Over torch a coalesced list uses the all-reduce; over MPI it travels flattened through the exchange.
    if reduce and collective == "exchange" and (packing != "coalesced" or transport == "mpi"):
        start, stop = parts(numel, num_facilities)[facility]
        scratch = torch.empty((num_facilities - 1) * (stop - start), dtype=group[0].dtype, device=device)
    return Communication(
        indices=tuple(dict.fromkeys(s.index for s in group)),
        spans=tuple((s.index, s.start, s.stop) for s in group),
        shapes=tuple(tuple(t.shape) for t in tensors),
        dtype=group[0].dtype,
        stream=stream,
        chunk=chunk,
        packing=packing,
        owner=owner,
        source=source,
        reduce=reduce,
        broadcast=broadcast,
        tensors=tensors,
        buffer=buffer,
        scratch=scratch,
    )
