"""Pure planners: how the shard's data is cut into collectives (no ``torch.distributed``).

Every builder sees the same input: this rank's shard of the selected parameters, cut
into ``num_chunks`` chunks (equal-as-possible pieces of the flat data, per dtype; see
:func:`cut_chunks`). It groups each chunk's *segments* (contiguous pieces of parameters'
local shards) into communications and assigns them to streams. Peers compute the same
plan from the same local shapes, so their collectives match one to one.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..distributed.state import to_local

__all__ = [
    "BUILDERS",
    "INPLACE_MIN_BYTES",
    "STRATEGIES",
    "Builder",
    "Plan",
    "Segment",
    "adjacent",
    "cut_chunks",
    "local_shard",
    "span_view",
]


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


def adjacent(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether ``tensors`` lie back to back in one storage, in order (one view spans them)."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        if (
            t.dtype != first.dtype
            or not t.is_contiguous()
            or t.storage_offset() != offset
            or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
        ):
            return False
        offset += t.numel()
    return True


def span_view(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
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
    if segs and adjacent([s.tensor for s in segs]):
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
        Builder(
            "layer_by_layer_optimized",
            "inplace",
            _layer_by_layer_optimized,
            "one collective per parameter, balanced by size over streams",
        ),
        Builder("bucket_flatten", "flatten", _bucket, "buckets of ~bucket_mb flattened with torch.cat each round"),
        Builder("bucket_coalesced", "coalesced", _bucket, "buckets of ~bucket_mb as coalesced lists"),
        Builder(
            "bucket_optimized_flatten", "flatten", _bucket_optimized, "flattened buckets balanced by size over streams"
        ),
        Builder(
            "bucket_optimized_coalesced",
            "coalesced",
            _bucket_optimized,
            "coalesced buckets balanced by size over streams",
        ),
        Builder("stacked", "stack", _stacked, "same-shape parameters stacked into one tensor"),
        Builder(
            "fused",
            "persistent",
            _fused,
            "bucket_mb buckets reduced where they lie (one view each over contiguous shards); "
            "otherwise small parameters staged in persistent buffers",
        ),
    )
}
STRATEGIES: tuple[str, ...] = tuple(BUILDERS)


# ----------------------------------------------------------------------------- chunks
def local_shard(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``param`` (a DTensor's local shard, else the tensor), detached."""
    return to_local(param).detach()


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
