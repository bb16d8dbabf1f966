"""Pure planning and validation of the process layout.

Numbers in, a frozen :class:`Layout` or a ``ConfigError`` out. Nothing here touches
``torch.distributed``: the launching process calls :func:`plan_layout` before any
worker starts, and every worker rebuilds the same plan from the same numbers.

Vocabulary (see ARCHITECTURE.md): the world is cut into contiguous *facilities*;
inside facility ``f`` the model is sharded over ``S`` ranks and the facility holds
``R_f = W_f / S`` *replicas* of that sharding. Rank inside facility ``f`` is
``offset_f + replica * S + shard``. *Peers* are ranks of other facilities that hold
the same shard.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from ..config.checks import is_int
from ..config.errors import ConfigError

__all__ = ["Coords", "Layout", "Exchange", "plan_layout"]


@dataclass(frozen=True)
class Coords:
    """Where one global rank sits in the layout."""

    rank: int
    facility: int
    facility_rank: int
    replica: int
    shard: int


@dataclass(frozen=True)
class Exchange:
    """One cross-facility reduction a shard takes part in.

    ``chunk`` of ``num_chunks`` equal pieces of the shard's data is reduced among
    ``ranks`` (exactly one rank per facility).
    """

    shard: int
    chunk: int
    num_chunks: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """The validated plan: facility sizes, shard size, processes per node."""

    world_size: int
    facility_sizes: tuple[int, ...]
    shard_size: int
    local_world_size: int

    # ----- sizes -------------------------------------------------------------
    @property
    def num_facilities(self) -> int:
        return len(self.facility_sizes)

    @property
    def facility_offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for size in self.facility_sizes:
            out.append(acc)
            acc += size
        return tuple(out)

    @property
    def replicas(self) -> tuple[int, ...]:
        """R_f per facility."""
        return tuple(size // self.shard_size for size in self.facility_sizes)

    @property
    def is_hsdp(self) -> bool:
        return any(r > 1 for r in self.replicas)

    # ----- coordinates -------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        for f, (offset, size) in enumerate(zip(self.facility_offsets, self.facility_sizes)):
            if rank < offset + size:
                local = rank - offset
                return Coords(rank, f, local, local // self.shard_size, local % self.shard_size)
        raise AssertionError("unreachable")

    def rank_of(self, facility: int, replica: int, shard: int) -> int:
        return self.facility_offsets[facility] + replica * self.shard_size + shard

    def facility_ranks(self, facility: int) -> tuple[int, ...]:
        offset = self.facility_offsets[facility]
        return tuple(range(offset, offset + self.facility_sizes[facility]))

    def shard_group_ranks(self, facility: int, replica: int) -> tuple[int, ...]:
        """The S ranks of one replica: one FSDP sharding of the model."""
        return tuple(self.rank_of(facility, replica, s) for s in range(self.shard_size))

    def replica_group_ranks(self, facility: int, shard: int) -> tuple[int, ...]:
        """The R_f ranks of a facility that hold the same shard."""
        return tuple(self.rank_of(facility, r, shard) for r in range(self.replicas[facility]))

    def peer_ranks(self, shard: int) -> tuple[int, ...]:
        """Every rank of every facility holding ``shard`` (all replicas)."""
        return tuple(self.rank_of(f, r, shard) for f in range(self.num_facilities) for r in range(self.replicas[f]))

    # ----- cross-facility exchanges -------------------------------------------
    @property
    def num_chunks(self) -> int:
        """Pieces a shard is cut into so that every replica of every facility owns
        an equal share: lcm of the replica counts."""
        return math.lcm(*self.replicas)

    def split_exchanges(self) -> tuple[Exchange, ...]:
        """Split mode: chunk ``c`` of shard ``s`` is reduced by replica ``c % R_f`` of
        each facility, so each facility sends one model copy per round in total."""
        c_total = self.num_chunks
        return tuple(
            Exchange(
                s,
                c,
                c_total,
                tuple(self.rank_of(f, c % r_f, s) for f, r_f in enumerate(self.replicas)),
            )
            for s in range(self.shard_size)
            for c in range(c_total)
        )

    def sender_exchanges(self) -> tuple[Exchange, ...]:
        """One-sender mode (xFFL): replica 0 of each facility reduces the whole shard."""
        return tuple(
            Exchange(s, 0, 1, tuple(self.rank_of(f, 0, s) for f in range(self.num_facilities)))
            for s in range(self.shard_size)
        )

    def chunk_owner(self, facility: int, chunk: int) -> int:
        """Replica of ``facility`` that reduces ``chunk`` in split mode."""
        return chunk % self.replicas[facility]

    # ----- reading -----------------------------------------------------------
    def describe(self) -> str:
        kind = "HSDP" if self.is_hsdp else "FSDP"
        lines = [
            f"world {self.world_size} = {self.num_facilities} facilities {list(self.facility_sizes)}"
            f", {kind} with shards of {self.shard_size}, {self.local_world_size} processes per node",
            f"{'facility':>8} {'ranks':>12} {'replicas':>8} {'shards':>6}",
        ]
        for f, size in enumerate(self.facility_sizes):
            off = self.facility_offsets[f]
            lines.append(f"{f:>8} {f'{off}..{off + size - 1}':>12} {self.replicas[f]:>8} {self.shard_size:>6}")
        return "\n".join(lines)


def _facility_sizes(world_size: int, federated: int | Sequence[int] | None) -> tuple[int, ...]:
    if federated is None:
        return (world_size,)
    if isinstance(federated, bool):
        raise ConfigError(f"distributed.federated must be an int or a list of ints, got {federated!r}")
    if isinstance(federated, int):
        if federated <= 0:
            raise ConfigError(
                f"distributed.federated={federated}: the facility size must be positive "
                f"(e.g. federated={max(1, world_size // 2)} for 2 facilities)"
            )
        if world_size % federated:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigError(
                f"distributed.federated={federated} does not divide the world size {world_size}: "
                f"use a facility size in {divisors}, or a list of sizes summing to {world_size}"
            )
        return (federated,) * (world_size // federated)
    sizes = tuple(federated)
    if not sizes or any(not is_int(s) or s <= 0 for s in sizes):
        raise ConfigError(f"distributed.federated={list(sizes)}: facility sizes must be positive integers")
    if sum(sizes) != world_size:
        raise ConfigError(
            f"distributed.federated={list(sizes)} sums to {sum(sizes)} processes but the world has "
            f"{world_size}: make the sizes sum to {world_size} or set distributed.nproc_per_node={sum(sizes)}"
        )
    return sizes


def plan_layout(
    world_size: int,
    federated: int | Sequence[int] | None = None,
    hsdp: int | None = None,
    local_world_size: int | None = None,
) -> Layout:
    """Plan the layout or raise ``ValueError`` naming the numbers and a valid alternative.

    Args:
        world_size: total processes of the job.
        federated: facility size (equal facilities), a list of facility sizes (contiguous
            blocks, may differ), or ``None`` for one facility holding the whole world.
        hsdp: shard size ``S`` inside each facility; ``None`` shards over the whole facility
            (FSDP). With ``S`` smaller than a facility the facility holds ``W_f/S`` replicas.
        local_world_size: processes per node (defaults to ``world_size``: one node).
    """
    if not is_int(world_size) or world_size <= 0:
        raise ConfigError(f"world size must be a positive integer, got {world_size!r}")
    local = world_size if local_world_size is None else local_world_size
    if not is_int(local) or local <= 0:
        raise ConfigError(f"processes per node must be a positive integer, got {local!r}")
    if world_size % local:
        raise ConfigError(
            f"world size {world_size} is not a multiple of {local} processes per node: "
            f"every node must run the same number of processes"
        )
    sizes = _facility_sizes(world_size, federated)
    if hsdp is None:
        if len(set(sizes)) > 1:
            common = math.gcd(*sizes)
            raise ConfigError(
                f"facilities of unequal sizes {list(sizes)} cannot each shard over the whole facility "
                f"(peers must hold the same shard): set distributed.hsdp to a common divisor, "
                f"e.g. distributed.hsdp={common}"
            )
        shard = sizes[0]
    else:
        if not is_int(hsdp) or hsdp <= 0:
            raise ConfigError(f"distributed.hsdp={hsdp!r}: the shard size must be a positive integer or null")
        bad = [s for s in sizes if s % hsdp]
        if bad:
            common = math.gcd(*sizes)
            choices = [d for d in range(1, common + 1) if common % d == 0]
            raise ConfigError(
                f"distributed.hsdp={hsdp} does not divide facility size(s) {bad} of {list(sizes)}: "
                f"the shard size must divide every facility; valid values are {choices} or null"
            )
        shard = hsdp
    return Layout(world_size=world_size, facility_sizes=sizes, shard_size=shard, local_world_size=local)
