"""Gossip across facilities: at round ``r`` each facility mixes only with its peers on that
round's edge of a topology (:mod:`xffl_like.parallel.topology`, Decent-DP's schedules and
mixing rule ``x_i <- w x_i + (1 - w)/(|R| - 1) sum_{j != i} x_j``).

Members are the facilities: for every shard index, the first replica of each facility
joins the topology over those ranks (in facility order) and then hands the mixed values to
the other replicas of its facility. ``alternating-exp-ring`` needs a node level: there the
members are every copy of the shard (all replicas of all facilities) and a facility is a
node of ``R`` consecutive copies, so one iteration averages two whole facilities and the
other averages inside each facility; it therefore needs a power-of-two number of
facilities with the same number (>= 2) of replicas each (``distributed.hsdp``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..config.errors import ConfigError
from ..parallel.topology import TOPOLOGIES, Edge, edge_group, topology_edges

__all__ = ["GOSSIP_TOPOLOGIES", "gossip_members", "check_gossip_layout", "Gossip"]

#: ``complete`` (the strategy's mean, no gossip) and every topology of :mod:`xffl_like.parallel.topology`.
GOSSIP_TOPOLOGIES = ("complete", *(name for name in TOPOLOGIES if name != "complete"))


def gossip_members(layout, name: str, shard: int) -> tuple[list[int], int]:
    """Ranks mixing the values of ``shard`` under topology ``name``, and members per node."""
    offsets = layout.facility_offsets
    if name == "alternating-exp-ring":
        ranks = [
            offsets[f] + r * layout.shard_size + shard
            for f in range(layout.num_facilities)
            for r in range(layout.replicas[f])
        ]
        return ranks, layout.replicas[0]
    return [offsets[f] + shard for f in range(layout.num_facilities)], 1


def check_gossip_layout(layout, name: str) -> None:
    """Raise ``ConfigError`` (one line, naming counts that work) when ``name`` cannot run on ``layout``."""
    if name not in GOSSIP_TOPOLOGIES:
        raise ConfigError(f"federation.topology={name!r}: use one of {', '.join(GOSSIP_TOPOLOGIES)}")
    n = layout.num_facilities
    if name == "alternating-exp-ring":
        if len(set(layout.replicas)) != 1 or layout.replicas[0] < 2 or n < 2 or n & (n - 1):
            raise ConfigError(
                f"federation.topology=alternating-exp-ring needs a power-of-two number of facilities (>= 2) with the "
                f"same number (>= 2) of replicas each, got {n} facilities with replicas {list(layout.replicas)}: "
                f"e.g. distributed.federated=2 distributed.hsdp=1 on 4 processes, or use topology ring"
            )
        return
    try:
        topology_edges(name, n)
    except ValueError as exc:
        msg = str(exc).replace("processes", "facilities")
        raise ConfigError(f"federation.topology={name} across {n} facilities: {msg}") from None


class Gossip:
    """Mix the local shards of ``params`` with this round's topology peers, in place.

    Collective: every rank of the job constructs it (each creates the groups it belongs to).
    """

    def __init__(self, name: str, params: Sequence[Tensor], state):
        layout = state.layout
        check_gossip_layout(layout, name)
        self.name, self.params, self.state = name, list(params), state
        # Every rank creates every edge's group, for every shard, in one order (topology.edge_group:
        # world-wide creation, each group made once and shared with any Topology over the same ranks).
        self.schedule: list[Edge] = []  # this rank's edge per iteration
        for s in range(layout.shard_size):
            ranks, local = gossip_members(layout, name, s)
            for iteration in topology_edges(name, len(ranks), local):
                for e in iteration:
                    members = sorted(ranks[p] for p in e.ranks)
                    group = edge_group(members) if len(members) > 1 else None
                    if state.rank in members:
                        self.schedule.append(Edge(members, e.weight, group))
        self.member = bool(self.schedule)
        self.numel = sum(p.numel() for p in self.params)

    @property
    def period(self) -> int:
        """Rounds after which the schedule repeats."""
        return len(self.schedule)

    @torch.no_grad()
    def mix(self, round_index: int) -> int:
        """Replace the parameters by this round's mix; returns bytes this rank sent across facilities."""
        state = self.state
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params]) if self.params else None
        sent = 0
        if flat is not None and self.member:
            edge = self.schedule[round_index % self.period]
            k = len(edge.ranks)
            if k > 1:
                total = flat.clone()
                dist.all_reduce(total, group=edge.group)
                others = edge.others_weight
                flat.mul_(edge.weight - others).add_(total, alpha=others)
                crosses = len({state.layout.coords(r).facility for r in edge.ranks}) > 1
                sent = 2 * (k - 1) * flat.nbytes // k if crosses else 0  # a ring all-reduce's sends
        if flat is not None and not self.name == "alternating-exp-ring" and state.num_replicas > 1:
            # The first replica mixed; the facility's other replicas take its result.
            src = state.layout.facility_offsets[state.facility] + state.shard
            dist.broadcast(flat, src=src, group=state.group("replica"))
        if flat is not None:
            offset = 0
            for p in self.params:
                p.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        return sent
