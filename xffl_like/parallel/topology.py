"""Communication topologies for gossip: who averages with whom at each iteration.

A topology is a periodic schedule. Iteration ``t`` partitions the members into
*edges*; every member sits in exactly one edge per iteration and mixes its values
with the other ranks of that edge (Decent-DP's rule):

    x_i <- w * x_i + (1 - w) / (|R| - 1) * sum_{j in R, j != i} x_j

so that every iteration's mixing matrix is symmetric and doubly stochastic (the
mean over all members never changes). A one-rank edge keeps its value.

The schedule is computed by a pure function of the member count (and processes
per node), :func:`topology_edges`, so it is testable without processes and reused
by any caller; :class:`Topology` maps it onto real ranks, which may be any list
of global ranks (the whole world for :class:`DecentralizedDataParallel`, the
facility leaders for gossip across facilities), and creates one process group per
distinct edge, once, on every process of the world in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

__all__ = ["Edge", "Topology", "TOPOLOGIES", "register_topology", "topology_edges", "edge_group", "background_group"]

# name -> fn(n members, processes per node) -> list (per iteration) of list of Edge over positions 0..n-1
TOPOLOGIES: dict[str, Callable[[int, int], list[list[Edge]]]] = {}


@dataclass
class Edge:
    """One group of ranks that mix together in one iteration.

    ``weight`` is the share each rank keeps of its own value; the rest is split
    evenly over the other ranks of the edge. ``group`` is the process group of
    ``ranks`` (``None`` until a :class:`Topology` creates it, or on non-members).
    """

    ranks: list[int]
    weight: float
    group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    # Hierarchical mixing of an edge that spans nodes (``Topology(hierarchical=True)``), on this
    # rank: its node's part of the edge, that part's first rank (its leader), and on leaders the
    # group of the parts' leaders. ``None`` where the edge is summed flat over ``group``.
    node_group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)
    node_leader: int | None = field(default=None, repr=False, compare=False)
    leaders_group: dist.ProcessGroup | None = field(default=None, repr=False, compare=False)

    @property
    def hierarchical(self) -> bool:
        """Whether this rank sums the edge in three steps (node, leaders, node) instead of flat."""
        return self.node_group is not None

    @property
    def others_weight(self) -> float:
        """Coefficient of each other rank's value in the mix (0 for a one-rank edge)."""
        return (1.0 - self.weight) / (len(self.ranks) - 1) if len(self.ranks) > 1 else 0.0


def register_topology(name: str):
    """Decorator: register ``fn(n, local_world_size) -> edges per iteration`` under ``name``."""

    def wrap(fn):
        TOPOLOGIES[name] = fn
        return fn

    return wrap


def _powers_of_two(start: int = 1) -> str:
    return ", ".join(str(2**k) for k in range(start, start + 4)) + ", ..."


@register_topology("complete")
def _complete(n: int, local: int) -> list[list[Edge]]:
    return [[Edge(list(range(n)), 1.0 / n)]]


@register_topology("ring")
def _ring(n: int, local: int) -> list[list[Edge]]:
    # One peer per iteration, alternating between the right and the left neighbour.
    if n % 2:
        raise ValueError(f"topology 'ring' needs an even number of processes, got {n}: use 2, 4, 6, 8, ...")
    right = [Edge(sorted([i, (i + 1) % n]), 0.5) for i in range(0, n, 2)]
    left = [Edge(sorted([i, (i - 1) % n]), 0.5) for i in range(0, n, 2)]
    return [right, left]


@register_topology("one-peer-exp")
def _one_peer_exp(n: int, local: int) -> list[list[Edge]]:
    # Iteration k pairs i with i + 2^k: log2(n) iterations reach exact consensus.
    rounds = round(math.log2(n)) if n > 0 else 0
    if n < 2 or 2**rounds != n:
        raise ValueError(
            f"topology 'one-peer-exp' needs a power-of-two number of processes, got {n}: use {_powers_of_two()}"
        )
    edges = []
    for k in range(rounds):
        used, its = set(), []
        for j in range(n):
            if j not in used:
                peer = (j + 2**k) % n
                used.update((j, peer))
                its.append(Edge(sorted([j, peer]), 0.5))
        edges.append(its)
    return edges


@register_topology("alternating-exp-ring")
def _alternating_exp_ring(n: int, local: int) -> list[list[Edge]]:
    # Nodes pair up exponentially (node j with node j + 2^k); each pair spends two
    # iterations: one averaging the two whole nodes together, one averaging inside
    # each node. Half of the pairs start with the node-pair exchange, half with the
    # intra-node one, so the inter-node links carry traffic in both iterations.
    nodes = n // local if local > 0 and n % local == 0 else 0
    rounds = round(math.log2(nodes)) if nodes > 0 else 0
    if local < 2 or nodes < 2 or n % local or 2**rounds != nodes:
        raise ValueError(
            f"topology 'alternating-exp-ring' needs a power-of-two number of nodes (>= 2) with >= 2 processes each, "
            f"got {n} processes with {local} per node: use e.g. 4 = 2x2, 8 = 2x4 or 4x2, 16 = 4x4 processes"
        )

    def node(j):
        return list(range(j * local, (j + 1) * local))

    edges, count = [], 0
    for k in range(rounds):
        first, second, used = [], [], set()
        for j in range(nodes):
            if j in used:
                continue
            t = (j + 2**k) % nodes
            used.update((j, t))
            pair = [Edge(node(j) + node(t), 1.0 / (2 * local))]
            inside = [Edge(node(j), 1.0 / local), Edge(node(t), 1.0 / local)]
            if count % 2 == 0:
                first += inside
                second += pair
            else:
                first += pair
                second += inside
            count += 1
        edges += [first, second]
    return edges


def topology_edges(name: str, n: int, local_world_size: int = 1) -> list[list[Edge]]:
    """The schedule of ``name`` over positions ``0..n-1``: one list of edges per iteration.

    Pure (no process groups). Raises ``ValueError`` naming the sizes that work.
    """
    if name not in TOPOLOGIES:
        raise ValueError(f"unknown topology {name!r}: choose one of {', '.join(sorted(TOPOLOGIES))}")
    if n < 1:
        raise ValueError(f"a topology needs at least one process, got {n}")
    edges = TOPOLOGIES[name](n, local_world_size)
    for t, iteration in enumerate(edges):  # a registered topology must be a partition every iteration
        seen = sorted(r for e in iteration for r in e.ranks)
        if seen != list(range(n)):
            raise ValueError(f"topology {name!r} iteration {t} does not use every process exactly once: {seen}")
    return edges


# Groups are created once per (world, ranks) and reused by every Topology that needs them.
HIERARCHICAL_CHANNEL = "hierarchical-mixing"  # edge_group channel of the node / leaders steps
_GROUPS: dict[tuple, dist.ProcessGroup | None] = {}


def edge_group(ranks: Sequence[int], channel: str = "", backend: str | None = None) -> dist.ProcessGroup | None:
    """The process group of ``ranks``, created on first use; ``None`` on a process outside ``ranks``.

    ``channel`` names a separate group over the same ranks (never the world group itself):
    collectives issued from two threads must not share a group, since the order in which
    the threads reach it may differ between ranks. ``backend`` (e.g. ``"gloo"``): the group's
    backend instead of the world's, for a background thread's work (:func:`background_group`).

    Collective over the world: EVERY process calls it for the same groups in the same
    order (members and non-members alike). Torch's group-local creation
    (``use_local_synchronization=True``) names a group after its ranks *and the number of
    groups the calling process already has*, so members that had created different numbers
    of groups (a leader of a larger node, a rank of the main job's layout) waited under
    different names and hung; a world-wide creation order has no such dependence.
    """
    ranks = tuple(sorted(ranks))
    world = dist.group.WORLD
    if len(ranks) == dist.get_world_size(world) and not channel and backend is None:
        return world
    key = (world, ranks, channel, backend)  # the WORLD object itself: a re-initialized world never hits a stale group
    if key not in _GROUPS:
        group = dist.new_group(list(ranks), backend=backend)
        _GROUPS[key] = group if dist.get_rank() in ranks else None
    return _GROUPS[key]


def background_group(ranks: Sequence[int], channel: str) -> dist.ProcessGroup | None:
    """A gloo group over ``ranks`` for the collectives of a background thread (``channel`` names it).

    NCCL from a second thread while the training thread issues NCCL collectives on other
    communicators can deadlock (two communicators' kernels, enqueued in different orders on
    different ranks, each waiting for the other on the GPU); gloo runs on the host, in its own
    threads, and cannot. The thread hands it CPU tensors. Collective over the world, like
    :func:`edge_group`.
    """
    return edge_group(ranks, channel, backend="gloo")


class Topology:
    """The schedule ``name`` over ``ranks`` (default: the whole world), with its process groups.

    ``local_world_size`` is the number of consecutive members per node (only
    ``alternating-exp-ring`` uses it; default ``LOCAL_WORLD_SIZE``-like 1).
    Collective over the world: every process constructs it with the same arguments (a
    process outside ``ranks`` takes part in creating the groups and has no edges).
    """

    def __init__(
        self,
        name: str = "complete",
        ranks: Sequence[int] | None = None,
        local_world_size: int = 1,
        hierarchical: bool = False,
    ):
        if not dist.is_initialized():
            raise RuntimeError("Topology needs torch.distributed to be initialized (dist.init_process_group)")
        self.name = name
        self.ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
        if len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"topology ranks must be distinct, got {self.ranks}")
        self.local_world_size = local_world_size
        positions = topology_edges(name, len(self.ranks), local_world_size)
        # Map positions to global ranks; every iteration's edges, for every member.
        self.schedule: list[list[Edge]] = [
            [Edge(sorted(self.ranks[p] for p in e.ranks), e.weight) for e in it] for it in positions
        ]
        me = dist.get_rank()
        self._mine: list[Edge] = []
        # Every process creates every edge's group in one global order (by iteration, then edge).
        for it in self.schedule:
            for e in it:
                if len(e.ranks) > 1:
                    group = edge_group(e.ranks)
                    if me in e.ranks:
                        e.group = group
                if hierarchical and local_world_size > 1:
                    # An edge over whole parts of several nodes: sum inside each node, among the
                    # nodes' leaders, then back inside the node. Across the link that is 1x the
                    # bytes each way instead of a flat ring all-reduce's 2(k-1)/k per node boundary.
                    parts = [
                        [r for r in e.ranks if r // local_world_size == n]
                        for n in sorted({r // local_world_size for r in e.ranks})
                    ]
                    if len(parts) > 1 and all(len(p) > 1 for p in parts):
                        # Groups of their own (a channel): the steps run on a communication thread,
                        # and must not share a group with the training thread's collectives.
                        node_groups = [edge_group(p, HIERARCHICAL_CHANNEL) for p in parts]
                        leaders = edge_group([p[0] for p in parts], HIERARCHICAL_CHANNEL)
                        if me in e.ranks:
                            k = next(i for i, p in enumerate(parts) if me in p)
                            e.node_group, e.node_leader = node_groups[k], parts[k][0]
                            e.leaders_group = leaders if me == parts[k][0] else None
            if me in self.ranks:
                self._mine.append(next(e for e in it if me in e.ranks))

    @property
    def period(self) -> int:
        """Number of iterations after which the schedule repeats."""
        return len(self.schedule)

    def get_edge(self, step: int) -> Edge:
        """This rank's edge at iteration ``step`` (the schedule repeats every :attr:`period`)."""
        if not self._mine:
            raise ValueError(f"rank {dist.get_rank()} is not a member of this topology (ranks {self.ranks})")
        return self._mine[step % len(self._mine)]

    def __repr__(self) -> str:
        return f"Topology({self.name!r}, ranks={self.ranks}, local_world_size={self.local_world_size})"
