"""Who talks to whom for the Bagua-style algorithms: the world, the node, the node leaders.

"Node" is a block of ``local_world_size`` consecutive ranks (the processes sharing a
host under torchrun, or a facility in the main job). Hierarchical algorithms reduce
inside the node, run among the node leaders (the first rank of every node), then
broadcast inside the node. Groups are created once, by their members only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .topology import edge_group

__all__ = ["NodeComm", "consensus_distance", "flat_copy", "node_comm", "p2p_exchange", "unflatten_into"]


@dataclass(frozen=True)
class NodeComm:
    """Ranks and groups of one process for node-hierarchical communication."""

    rank: int
    world_size: int
    local_world_size: int
    node: int
    node_ranks: tuple[int, ...]
    leaders: tuple[int, ...]
    node_group: dist.ProcessGroup | None  # None when the node is this process alone
    leader_group: dist.ProcessGroup | None  # None on non-leaders or with one node

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

    def node_broadcast(self, t: Tensor) -> None:
        """Copy the leader's ``t`` to every process of the node."""
        if self.node_group is not None:
            dist.broadcast(t, self.leader, group=self.node_group)


def node_comm(local_world_size: int | None = None) -> NodeComm:
    """Build this process's :class:`NodeComm` (collective over the world: every process calls it).

    ``local_world_size`` defaults to ``LOCAL_WORLD_SIZE``; it must divide the world size.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(local_world_size or os.environ.get("LOCAL_WORLD_SIZE", world))
    if local < 1 or world % local:
        raise ValueError(f"local_world_size={local} must divide the world size {world} (processes per node)")
    node = rank // local
    node_ranks = tuple(range(node * local, (node + 1) * local))
    leaders = tuple(range(0, world, local))
    node_group = edge_group(node_ranks) if local > 1 else None
    leader_group = edge_group(leaders) if rank in leaders and len(leaders) > 1 else None
    return NodeComm(rank, world, local, node, node_ranks, leaders, node_group, leader_group)


def p2p_exchange(sends: list[tuple[Tensor, int]], recvs: list[tuple[Tensor, int]]) -> list:
    """Post sends and receives together (no ordering deadlock); returns the works to wait on."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    return dist.batch_isend_irecv(ops) if ops else []


def flat_copy(tensors: list[Tensor], out: Tensor | None = None) -> Tensor:
    """Concatenate ``tensors`` into one flat buffer (reused when ``out`` is given)."""
    if out is None:
        return torch.cat([t.detach().reshape(-1) for t in tensors])
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()].copy_(t.detach().reshape(-1))
        offset += t.numel()
    return out


def unflatten_into(flat: Tensor, tensors: list[Tensor]) -> None:
    """Copy consecutive slices of ``flat`` back into ``tensors``."""
    offset = 0
    for t in tensors:
        t.detach().copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


@torch.no_grad()
def consensus_distance(module: torch.nn.Module, group: dist.ProcessGroup | None = None) -> float:
    """Mean over the ranks of ``group`` (default: the world) of the L2 distance between this
    rank's parameters and their average over the ranks (collective; 0 when all copies agree)."""
    params = [p for p in module.parameters()]
    if not params:
        return 0.0
    n = dist.get_world_size(group)
    mine = flat_copy(params).to(torch.float64)
    mean = mine.clone()
    dist.all_reduce(mean, group=group)
    distance = torch.linalg.vector_norm(mine - mean.div_(n)).reshape(1)
    dist.all_reduce(distance, group=group)
    return float(distance) / n
