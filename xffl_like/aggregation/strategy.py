"""The immutable aggregation plan: what is communicated, on which stream, by whom.

A :class:`Strategy` is built once per (model, state, options) after FSDP wrapping
(see :func:`.builders.build_strategy`) and read by the executor every round. It holds views of the
parameters' local shards (and, for ``fused``, persistent flat buffers), so the data
it moves is always the model's own. Equality and hashing look at the plan only
(indices, spans, shapes, dtypes, streams, options), never at tensor storage: building
twice from the same inputs gives equal strategies.

Vocabulary: the communicated data of this rank's shard is cut into ``num_chunks``
chunks; chunk ``c`` is reduced across facilities by exactly one rank per facility
(its *owner* replica), which then broadcasts the result to the other replicas of
its facility. In ``one_sender`` mode there is one chunk, owned by replica 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PACKINGS", "AGGREGATION_MODES", "COLLECTIVES", "TRANSPORTS", "Communication", "Strategy", "parts"]

#: How a communication's tensors travel: ``inplace`` (one contiguous view of a parameter,
#: reduced where it lies), ``coalesced`` (a list in one coalesced collective), ``flatten``
#: (``torch.cat`` into a fresh flat tensor each round), ``stack`` (``torch.stack`` of
#: same-shape tensors each round), ``persistent`` (copied into a flat buffer allocated once).
PACKINGS = ("inplace", "coalesced", "flatten", "stack", "persistent")
#: How a facility's replicas share the cross-facility reduction (see :attr:`Strategy.mode`).
AGGREGATION_MODES = ("split", "one_sender")
#: ``all_reduce``: the backend's all-reduce; ``exchange``: reduce-scatter + all-gather by
#: point-to-point messages with the weights applied in the reduction (see the executor).
COLLECTIVES = ("all_reduce", "exchange")
#: What carries the cross-facility messages: ``torch`` (the facilities' peer process groups)
#: or ``mpi`` (the exchange's messages through :mod:`xffl_like.comm`'s MPI backend, for sites
#: whose inter-facility path only speaks MPI). Inside a facility it is always torch.
TRANSPORTS = ("torch", "mpi")


def parts(numel: int, n: int) -> list[tuple[int, int]]:
    """``n`` equal-as-possible ``(start, stop)`` ranges of ``numel`` elements: in an
    exchange, part ``j`` is reduced by the peer of facility ``j``."""
    bounds = [j * numel // n for j in range(n + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class Communication:
    """One collective of the plan (plus its broadcast inside the facility).

    ``spans[k] = (param_index, start, stop)``: ``tensors[k]`` is elements ``start:stop`` of
    that parameter's flattened local shard (the whole shard, with its shape, when it fits).
    Exception: an ``inplace`` communication over several spans that lie back to back in
    memory (see ``train.parallelize.contiguous_shards``) has one 1-D tensor spanning them.
    """

    indices: tuple[int, ...]
    spans: tuple[tuple[int, int, int], ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: torch.dtype
    stream: int
    chunk: int
    #: One of :data:`PACKINGS`; ``fused`` reduces single contiguous views ``inplace``.
    packing: str
    #: Replica of this rank's facility that joins the cross-facility reduction of ``chunk``.
    owner: int
    #: Global rank of that owner: the broadcast source inside the facility.
    source: int
    #: This rank joins the cross-facility reduction.
    reduce: bool
    #: The facility has more than one replica, so the owner broadcasts the result.
    broadcast: bool
    tensors: tuple[torch.Tensor, ...] = field(compare=False, repr=False)
    #: Persistent staging buffer (``persistent`` packing).
    buffer: torch.Tensor | None = field(default=None, compare=False, repr=False)
    #: Persistent receive buffer of an ``exchange`` this rank reduces in.
    scratch: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def numel(self) -> int:
        return sum(stop - start for _, start, stop in self.spans)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Strategy:
    """A named, immutable aggregation plan for one rank."""

    name: str
    #: ``split``: the replicas of a facility share the cross-facility reduction (chunk ``c`` is
    #: reduced by replica ``c % R_f``); ``one_sender``: replica 0 reduces everything (xFFL).
    mode: str
    num_streams: int
    bucket_mb: float
    #: The builder's packing, one of :data:`PACKINGS` (each communication has its own).
    packing: str
    #: One of :data:`COLLECTIVES` (coalesced lists always use ``all_reduce``).
    collective: str
    #: How the mean is formed. ``sum``: each facility's contribution is pre-scaled by
    #: ``w_f / sum(w)``, then summed (a backend without AVG); ``avg``: AVG (sum, then divide by
    #: F) for uniform weights, pre-scaled SUM otherwise (gloo in recent torch); ``premul_sum``:
    #: AVG for uniform weights, PREMUL_SUM otherwise (NCCL scales inside the reduction).
    reduce_op: str
    num_facilities: int
    num_chunks: int
    #: Names of all parameters, in ``model.named_parameters()`` order; ``selected`` indexes it.
    param_names: tuple[str, ...]
    selected: tuple[int, ...]
    #: Bytes of one full (unsharded) copy of the selected parameters.
    model_bytes: int
    communications: tuple[Communication, ...]
    #: One of :data:`TRANSPORTS`; ``mpi`` always runs the ``exchange``.
    transport: str = "torch"
    #: The MPI communicator of the ``mpi`` transport (a private duplicate of the world's).
    mpi_comm: Any = field(default=None, compare=False, repr=False)

    @property
    def contiguous(self) -> bool:
        """Whether tensors are packed into contiguous buffers before communicating."""
        return any(c.packing in ("flatten", "stack", "persistent") for c in self.communications)

    @property
    def dtypes(self) -> tuple[torch.dtype, ...]:
        return tuple(dict.fromkeys(c.dtype for c in self.communications))

    @property
    def bytes_per_rank(self) -> int:
        """Bytes this rank contributes to cross-facility reductions each round."""
        return sum(c.nbytes for c in self.communications if c.reduce)

    @property
    def cross_facility_bytes(self) -> int:
        """Bytes crossing facility boundaries per round for the whole job: every facility
        contributes one copy of the selected parameters (in either mode)."""
        return self.num_facilities * self.model_bytes if self.num_facilities > 1 else 0

    def describe(self) -> str:
        reduce = [c for c in self.communications if c.reduce]
        return (
            f"strategy {self.name} ({self.mode}, {self.packing}, {self.num_streams} stream(s), {self.transport}): "
            f"{len(self.selected)}/{len(self.param_names)} parameters, {len(reduce)} cross-facility "
            f"collectives of {len(self.communications)}, {self.bytes_per_rank / 2**20:.2f} MiB sent by this rank"
        )
