"""Named strategy builders: how the shard's data is cut into collectives.

Every builder sees the same input: this rank's shard of the selected parameters, cut
into ``num_chunks`` chunks (equal-as-possible pieces of the flat data, per dtype; see
:func:`cut_chunks`). It groups each chunk's *segments* (contiguous pieces of parameters'
local shards) into communications and assigns them to streams. Peers compute the same
plan from the same local shapes, so their collectives match one to one.
"""

from __future__ import annotations

import fnmatch
import functools
import heapq
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .strategy import COLLECTIVES, MODES, TRANSPORTS, Communication, Strategy, parts
from ..checks import is_int, is_number

__all__ = [
    "Segment",
    "check_collective",
    "StrategyOptions",
    "BUILDERS",
    "STRATEGIES",
    "validate_strategy_options",
    "select_parameters",
    "cut_chunks",
    "build_strategy",
]

_KEYS = ("name", "streams", "bucket_mb", "mode", "only", "transport")


class Segment(NamedTuple):
    """Elements ``start:stop`` of parameter ``index``'s flattened local shard."""

    index: int
    start: int
    stop: int
    tensor: torch.Tensor  # a view: the whole local shard (its shape) or a 1-D slice of it

    @property
    def nbytes(self) -> int:
        return (self.stop - self.start) * self.tensor.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


@dataclass(frozen=True)
class StrategyOptions:
    """``conf/strategy/*.yaml`` after validation."""

    name: str
    streams: int = 1
    bucket_mb: float = 25.0
    mode: str = "split"
    only: tuple[str, ...] | None = None
    transport: str = "torch"


# ----------------------------------------------------------------------------- planners
# A planner maps the chunks' segments to [(segments, stream), ...] for each chunk.
Plan = list[tuple[list[Segment], int]]


def _round_robin(groups: list[list[Segment]], streams: int) -> Plan:
    return [(g, i % streams) for i, g in enumerate(groups)]


def _balanced(groups: list[list[Segment]], streams: int) -> Plan:
    """Greedy largest-first: each group goes to the least-loaded stream (ties: lowest index).
    The plan keeps the groups' original order, so issue order follows the model."""
    load = [(0, s) for s in range(streams)]
    stream_of = {}
    order = sorted(range(len(groups)), key=lambda i: (-sum(x.nbytes for x in groups[i]), i))
    for i in order:
        bytes_, s = heapq.heappop(load)
        stream_of[i] = s
        heapq.heappush(load, (bytes_ + sum(x.nbytes for x in groups[i]), s))
    return [(g, stream_of[i]) for i, g in enumerate(groups)]


def _by_dtype(segments: list[Segment]) -> list[list[Segment]]:
    out: dict[torch.dtype, list[Segment]] = {}
    for seg in segments:
        out.setdefault(seg.dtype, []).append(seg)
    return list(out.values())


def _buckets(segments: list[Segment], cap: int, split: bool) -> list[list[Segment]]:
    """Consecutive segments of one dtype in buckets of about ``cap`` bytes. With ``split``,
    segments are cut at bucket boundaries so every bucket but the last holds exactly ``cap``
    bytes; without, a bucket closes before the segment that would overflow it."""
    out: list[list[Segment]] = []
    for same in _by_dtype(segments):
        size = same[0].tensor.element_size()
        cap_numel = max(1, cap // size)
        bucket: list[Segment] = []
        filled = 0
        for seg in same:
            if not split:
                if bucket and filled + (seg.stop - seg.start) > cap_numel:
                    out.append(bucket)
                    bucket, filled = [], 0
                bucket.append(seg)
                filled += seg.stop - seg.start
                continue
            start = seg.start
            while start < seg.stop:
                take = min(seg.stop - start, cap_numel - filled)
                bucket.append(_subsegment(seg, start, start + take))
                filled += take
                start += take
                if filled == cap_numel:
                    out.append(bucket)
                    bucket, filled = [], 0
        if bucket:
            out.append(bucket)
    return out


def _stacks(segments: list[Segment]) -> list[list[Segment]]:
    """Segments of the same dtype and shape, in order of first appearance."""
    out: dict[tuple, list[Segment]] = {}
    for seg in segments:
        out.setdefault((seg.dtype, tuple(seg.tensor.shape)), []).append(seg)
    return list(out.values())


def _layer_by_layer(segs, streams, cap):
    return _round_robin([[s] for s in segs], streams)


def _layer_by_layer_optimized(segs, streams, cap):
    return _balanced([[s] for s in segs], streams)


def _bucket(segs, streams, cap):
    return _round_robin(_buckets(segs, cap, split=False), streams)


def _bucket_optimized(segs, streams, cap):
    return _balanced(_buckets(segs, cap, split=False), streams)


def _stacked(segs, streams, cap):
    return _balanced(_stacks(segs), streams)


#: Below this size a collective's fixed cost dominates, so ``fused`` stages such segments
#: into persistent buffers; at or above it (or a whole bucket's worth) a segment is already
#: a contiguous view and is reduced where it lies: staging would cost two memory passes.
#: Measured with gloo on a 2-core CPU (llama_bench): staging the 0.5 MB attention shards
#: cost more than their extra messages, so only norms and similar stay below.
INPLACE_MIN_BYTES = 256 * 1024


def _adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` lie back to back in one storage, in order (one view spans them)."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or not t.is_contiguous() or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):
            return False
        offset += t.numel()
    return True


def _span_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One 1-D view over adjacent ``tensors``."""
    first = tensors[0]
    numel = sum(t.numel() for t in tensors)
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))


def _fused(segs, streams, cap):
    """Bucket-size pieces of the flat shard data, in model order, streams round-robin.

    When the shards lie back to back in memory (``train.parallelize.contiguous_shards``),
    each bucket is one view: reduced in place, one message, no copies. Otherwise large
    segments are reduced in place (cut into bucket-size pieces) and small ones staged in
    bucket-size persistent buffers."""
    if segs and _adjacent([s.tensor for s in segs]):
        return _round_robin(_buckets(segs, cap, split=True), streams)
    groups, staged = [], []
    for seg in segs:
        if seg.nbytes < min(cap, INPLACE_MIN_BYTES):
            staged.append(seg)
            continue
        step = max(1, cap // seg.tensor.element_size())
        groups += [[_subsegment(seg, a, min(a + step, seg.stop))] for a in range(seg.start, seg.stop, step)]
    groups += _buckets(staged, cap, split=True)
    groups.sort(key=lambda g: (g[0].index, g[0].start))
    return _round_robin(groups, streams)


@dataclass(frozen=True)
class Builder:
    name: str
    packing: str
    plan: Callable[[list[Segment], int, int], Plan]
    doc: str


BUILDERS: dict[str, Builder] = {
    b.name: b
    for b in (
        Builder("layer_by_layer", "inplace", _layer_by_layer, "one collective per parameter, streams round-robin"),
        Builder("layer_by_layer_optimized", "inplace", _layer_by_layer_optimized, "one collective per parameter, balanced by size over streams"),
        Builder("bucket_flatten", "flatten", _bucket, "buckets of ~bucket_mb flattened with torch.cat each round"),
        Builder("bucket_coalesced", "coalesced", _bucket, "buckets of ~bucket_mb as coalesced lists"),
        Builder("bucket_optimized_flatten", "flatten", _bucket_optimized, "flattened buckets balanced by size over streams"),
        Builder("bucket_optimized_coalesced", "coalesced", _bucket_optimized, "coalesced buckets balanced by size over streams"),
        Builder("stacked", "stack", _stacked, "same-shape parameters stacked into one tensor"),
        Builder("fused", "persistent", _fused, "bucket_mb buckets reduced where they lie (one view each over contiguous shards); otherwise small parameters staged in persistent buffers"),
    )
}
STRATEGIES: tuple[str, ...] = tuple(BUILDERS)


# ----------------------------------------------------------------------------- options
def _looks_like_class_name(pattern: str) -> bool:
    return pattern.isidentifier() and pattern[0].isupper()


def validate_strategy_options(
    options: Mapping[str, Any],
    param_names: Sequence[str] | None = None,
    *,
    model: nn.Module | None = None,
) -> StrategyOptions:
    """Check ``options`` (a ``conf/strategy`` mapping) and return them normalised.

    Raises ``ValueError`` with one sentence naming the bad value and the valid ones. With
    ``param_names``, every ``only`` pattern must match a parameter name (a bare capitalised
    identifier is taken for a module class name and only checked when ``model`` is given).
    """
    if not isinstance(options, Mapping):
        raise ValueError(f"strategy options must be a mapping with keys {list(_KEYS)}, got {type(options).__name__}")
    unknown = [k for k in options if k not in _KEYS]
    if unknown:
        raise ValueError(f"unknown strategy option(s) {unknown}: valid keys are {list(_KEYS)}")
    name = options.get("name")
    if name not in BUILDERS:
        raise ValueError(f"unknown strategy name {name!r}: valid names are {list(STRATEGIES)}")
    streams = options.get("streams", 1)
    if not is_int(streams) or streams < 1:
        raise ValueError(f"strategy.streams={streams!r}: need an integer of at least 1")
    bucket_mb = options.get("bucket_mb", 25.0)
    if not is_number(bucket_mb) or not bucket_mb > 0:
        raise ValueError(f"strategy.bucket_mb={bucket_mb!r}: need a positive number of megabytes")
    mode = options.get("mode", "split")
    if mode not in MODES:
        raise ValueError(f"strategy.mode={mode!r}: valid modes are {list(MODES)}")
    only = options.get("only")
    if only is not None:
        if isinstance(only, str):
            only = [only]
        only = tuple(only)
        if not only or not all(isinstance(p, str) and p for p in only):
            raise ValueError(f"strategy.only={list(only)}: need a non-empty list of parameter-name globs or module class names, or null")
    transport = options.get("transport", "torch")
    if transport not in TRANSPORTS:
        raise ValueError(f"strategy.transport={transport!r}: valid transports are {list(TRANSPORTS)}")
    if transport == "mpi":
        _check_mpi_transport()
    opts = StrategyOptions(name=name, streams=streams, bucket_mb=float(bucket_mb), mode=mode, only=only,
                           transport=transport)

    if only is not None and (param_names is not None or model is not None):
        named = list(model.named_parameters()) if model is not None else None
        names = [n for n, _ in named] if named is not None else list(param_names)
        classes = _owner_classes(model) if model is not None else None
        for pattern in only:
            if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                continue
            if classes is None and _looks_like_class_name(pattern):
                continue
            if classes is not None and any(pattern in c for c in classes.values()):
                continue
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise ValueError(
                f"strategy.only pattern {pattern!r} matches no parameter name"
                + ("" if classes is None else " nor module class")
                + f": parameters look like {shown}"
            )
    return opts


def _check_mpi_transport() -> None:
    """``strategy.transport=mpi`` needs mpi4py and processes started by an MPI launcher (so
    that MPI connects them); checked without initialising MPI."""
    from ..comm import MPI_EXTRA, mpi_installed
    from ..distributed.env import mpi_launched

    if not mpi_installed():
        raise ValueError(f"strategy.transport=mpi needs mpi4py and an MPI runtime: install the mpi extra ({MPI_EXTRA})")
    if not mpi_launched():
        raise ValueError(
            "strategy.transport=mpi needs the job started by an MPI launcher, e.g. "
            "mpirun -n 4 python -m xffl_like.run strategy.transport=mpi (or use strategy.transport=torch)"
        )


def _mpi_communicator(state):
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


@functools.lru_cache(maxsize=None)
def _private_world():
    # One duplicate of MPI_COMM_WORLD per process, shared by all strategies: their tags meet
    # no one else's messages, and a round completes before the next starts.
    from ..comm import get_mpi

    return get_mpi().COMM_WORLD.Dup()


def _owner_classes(model: nn.Module) -> dict[str, set[str]]:
    """Parameter name -> class names of every module containing it (FSDP2 wraps classes
    as ``FSDP<Name>``: the MRO keeps the original name)."""
    out: dict[str, set[str]] = {}
    for mod_name, module in model.named_modules():
        names = {cls.__name__ for cls in type(module).__mro__}
        prefix = f"{mod_name}." if mod_name else ""
        for p_name, _ in module.named_parameters():
            out.setdefault(prefix + p_name, set()).update(names)
    return out


def select_parameters(model: nn.Module, only: Sequence[str] | None) -> tuple[int, ...]:
    """Indices (in ``named_parameters()`` order) of the parameters to aggregate."""
    names = [n for n, _ in model.named_parameters()]
    if only is None:
        return tuple(range(len(names)))
    classes = _owner_classes(model)
    return tuple(
        i
        for i, n in enumerate(names)
        if any(fnmatch.fnmatchcase(n, p) or p in classes.get(n, ()) for p in only)
    )


# ----------------------------------------------------------------------------- chunks
def _local(param: torch.Tensor) -> torch.Tensor:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.detach()


def _subsegment(seg: Segment, start: int, stop: int) -> Segment:
    if start == seg.start and stop == seg.stop:
        return seg
    flat = seg.tensor.view(-1)
    return Segment(seg.index, start, stop, flat[start - seg.start : stop - seg.start])


def cut_chunks(locals_: Sequence[tuple[int, torch.Tensor]], num_chunks: int) -> list[list[Segment]]:
    """Cut the flat data of the given local shards into ``num_chunks`` chunks.

    Per dtype, the shards' elements (in order) are cut into pieces whose sizes differ by at
    most one; empty shards are skipped. A shard that falls whole into a chunk keeps its
    shape; one that crosses a boundary is split into 1-D slices.
    """
    chunks: list[list[Segment]] = [[] for _ in range(num_chunks)]
    by_dtype: dict[torch.dtype, list[tuple[int, torch.Tensor]]] = {}
    for index, local in locals_:
        if local.numel():
            by_dtype.setdefault(local.dtype, []).append((index, local))
    for group in by_dtype.values():
        total = sum(t.numel() for _, t in group)
        bounds = [c * total // num_chunks for c in range(num_chunks + 1)]
        offset = 0
        for index, local in group:
            whole = Segment(index, 0, local.numel(), local)
            for c in range(num_chunks):
                lo = max(bounds[c], offset) - offset
                hi = min(bounds[c + 1], offset + local.numel()) - offset
                if lo < hi:
                    chunks[c].append(_subsegment(whole, lo, hi))
            offset += local.numel()
    for chunk in chunks:  # keep model order across dtypes
        chunk.sort(key=lambda s: (s.index, s.start))
    return chunks


# ----------------------------------------------------------------------------- build
def check_collective(collective: str | None, backend: str, key: str = "collective") -> None:
    """Refuse ``exchange`` on nccl with one line. The exchange is gloo's remedy (one message per
    peer instead of a ring synchronised per segment, no AVG needed); NCCL's all-reduce has AVG
    and PREMUL_SUM built in, and the exchange's point-to-point path is not exercised there."""
    if collective == "exchange" and backend == "nccl":
        raise ValueError(f"{key}=exchange is for gloo; on nccl use {key}=all_reduce (or null: the backend's default)")


def build_strategy(model: nn.Module, state, options: Mapping[str, Any], *, collective: str | None = None) -> Strategy:
    """Plan the aggregation of ``model`` (already FSDP-wrapped) for this rank.

    Call once on every rank after ``fully_shard`` and reuse the result every round.
    ``state`` is the worker's :class:`~xffl_like.distributed.state.DistributedState`.
    ``collective`` (see :attr:`Strategy.collective`) defaults to ``exchange`` on gloo and
    ``all_reduce`` elsewhere.
    """
    opts = validate_strategy_options(options, model=model)
    if opts.transport == "mpi":  # MPI carries the exchange's messages; there is no MPI all-reduce path
        if collective not in (None, "exchange"):
            raise ValueError(f"collective={collective!r} with strategy.transport=mpi: the mpi transport runs the exchange")
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
    named = list(model.named_parameters())
    selected = select_parameters(model, opts.only)
    locals_ = [(i, _local(named[i][1])) for i in selected]
    for i, local in locals_:
        if not local.is_contiguous():
            raise ValueError(f"parameter {named[i][0]!r} has a non-contiguous local shard: cannot aggregate it in place")
    model_bytes = sum(named[i][1].numel() * named[i][1].element_size() for i in selected)

    layout = state.layout
    facility, replica = state.facility, state.replica
    split = opts.mode == "split"
    num_chunks = layout.num_chunks if split else 1
    communications: list[Communication] = []
    if state.num_facilities > 1:
        builder = BUILDERS[opts.name]
        cap = max(1, int(opts.bucket_mb * 2**20))
        for c, segments in enumerate(cut_chunks(locals_, num_chunks)):
            owner = layout.chunk_owner(facility, c) if split else 0
            for group, stream in builder.plan(segments, opts.streams, cap):
                communications.append(
                    _communication(group, stream, c, owner, layout.rank_of(facility, owner, state.shard),
                                   owner == replica, state.num_replicas > 1, builder.packing,
                                   collective, facility, state.num_facilities, opts.transport)
                )
    return Strategy(
        name=opts.name,
        mode=opts.mode,
        num_streams=opts.streams,
        bucket_mb=opts.bucket_mb,
        packing=BUILDERS[opts.name].packing,
        collective=collective,
        reduce_op=_reduce_op(state.backend),
        num_facilities=state.num_facilities,
        num_chunks=num_chunks,
        param_names=tuple(n for n, _ in named),
        selected=selected,
        model_bytes=model_bytes,
        communications=tuple(communications),
        transport=opts.transport,
        mpi_comm=_mpi_communicator(state) if opts.transport == "mpi" and state.num_facilities > 1 else None,
    )


def _reduce_op(backend: str) -> str:
    """How the executor forms the mean on ``backend`` (see :attr:`Strategy.reduce_op`)."""
    if backend == "nccl":
        return "premul_sum"
    if backend == "gloo" and _gloo_has_avg():
        return "avg"
    return "sum"


@functools.lru_cache(maxsize=None)
def _gloo_has_avg() -> bool:
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


def _communication(group: list[Segment], stream: int, chunk: int, owner: int, source: int,
                   reduce: bool, broadcast: bool, packing: str, collective: str,
                   facility: int, num_facilities: int, transport: str = "torch") -> Communication:
    tensors = tuple(s.tensor for s in group)
    device = group[0].tensor.device
    numel = sum(s.stop - s.start for s in group)
    buffer = scratch = None
    if packing == "persistent" and _adjacent(tensors):
        packing = "inplace"  # one contiguous view: nothing to stage
        tensors = (_span_view(tensors),) if len(tensors) > 1 else tensors
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
