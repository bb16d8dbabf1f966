"""DistributedState: everything distributed about one worker, built once, never mutated.

Built from a validated :class:`~xffl_like.distributed.layout.Layout` and the process
environment (torchrun, Slurm or an MPI launcher: see :mod:`.env`; or explicit values).
It owns the process group, the DeviceMesh for FSDP/HSDP inside the facility and one
handle per communication stream for every group the aggregation uses. Nothing else calls ``dist.get_rank()``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .device import choose_backend, cuda_defaults, cuda_device
from .env import ProcessEnv, read_env
from .layout import Coords, Exchange, Layout

__all__ = [
    "GROUP_NAMES",
    "ProcessEnv",
    "PeerExchange",
    "DistributedState",
    "read_env",
    "build_state",
    "resolve_backend",
    "group_backend",
    "init_default_group",
    "elastic_store",
    "to_local",
]

#: The process groups a :class:`DistributedState` owns, by name (:meth:`DistributedState.group`).
GROUP_NAMES = {
    "world": "every process of the job (the default group)",
    "facility": "every rank of this rank's facility (one handle per stream)",
    "replica": "the ranks of this facility holding this rank's shard, one per replica (one handle per stream)",
    "shard": "the ranks over which this rank's copy of the model is sharded (FSDP)",
    "peers": "every rank of every facility and replica holding this rank's shard (divergence, gradient averaging)",
    "senders": "the first replica of every facility holding this rank's shard (one per stream; None elsewhere)",
    "background": "the whole world on gloo, for collectives of a background thread (async checkpoint saves)",
    "overlap_peers": "like senders, for an exchange overlapping local steps only (None on other replicas)",
    "overlap_replicas": "like replica, for an exchange overlapping local steps only",
}


def to_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's local tensor of ``t``: its shard for a DTensor, ``t`` itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def elastic_store(env: ProcessEnv, timeout: timedelta):
    """The store of the default process group, or ``None`` for torch's default (``env://``).

    - Under an elastic agent that shares its store (torchrun's default), a prefix per restart
      attempt: the store outlives attempts, and a restarted worker would otherwise read the
      dead attempt's peer addresses.
    - With a loopback rendezvous address, rank 0 hosts the store listening on 127.0.0.1 only
      (torch's own server binds every interface).
    """
    if env.master_addr is None or env.master_port is None:
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        client = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"/xffl/attempt_{attempt}", client)
    if env.master_addr in ("127.0.0.1", "localhost"):
        from .launch import loopback_store

        if env.rank == 0:
            store = loopback_store(env.master_port, env.world_size, timeout.total_seconds())[0]
        else:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        return dist.PrefixStore("default_pg", store)  # the prefix torch's env:// path uses
    return None


@dataclass(frozen=True)
class PeerExchange:
    """A cross-facility reduction this rank joins: the plan plus one group per stream."""

    exchange: Exchange
    groups: tuple[dist.ProcessGroup, ...]


@dataclass(frozen=True, eq=False)
class DistributedState:
    """Frozen view of one worker's place in the job. Compare by identity."""

    layout: Layout
    env: ProcessEnv
    coords: Coords
    backend: str
    device: torch.device
    init_device: torch.device
    mesh: DeviceMesh
    groups: Mapping[str, tuple]  # name (GROUP_NAMES) -> one handle per stream (or one)
    split_exchanges: tuple[PeerExchange, ...]
    sender_exchanges: tuple[PeerExchange, ...]
    streams: tuple = field(default=())
    num_streams: int = 1

    def group(self, name: str, stream: int = 0) -> dist.ProcessGroup | None:
        """The process group ``name`` (one of :data:`GROUP_NAMES`) for communication stream ``stream``.

        Every group is built once, by :func:`build_state`, in the same order on every rank; None
        where this rank is not a member (``senders`` on replicas other than the first)."""
        if name not in self.groups:
            if name in GROUP_NAMES:
                raise KeyError(f"process group {name!r} was not built: build_state(..., overlap=True) builds it")
            raise KeyError(f"no process group {name!r}: the names are {', '.join(GROUP_NAMES)}")
        handles = self.groups[name]
        return handles[stream] if len(handles) > 1 else handles[0]

    # Short names the rest of the code reads.
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def local_world_size(self) -> int:
        return self.env.local_world_size

    @property
    def facility(self) -> int:
        return self.coords.facility

    @property
    def num_facilities(self) -> int:
        return self.layout.num_facilities

    @property
    def facility_rank(self) -> int:
        return self.coords.facility_rank

    @property
    def facility_size(self) -> int:
        return self.layout.facility_sizes[self.coords.facility]

    @property
    def replica(self) -> int:
        return self.coords.replica

    @property
    def num_replicas(self) -> int:
        return self.layout.replicas[self.coords.facility]

    @property
    def shard(self) -> int:
        return self.coords.shard

    @property
    def shard_size(self) -> int:
        return self.layout.shard_size

    @property
    def is_hsdp(self) -> bool:
        return self.mesh.ndim == 2

    def group_backends(self) -> dict[str, str | None]:
        """The backend of every process group this rank built, by name (:data:`GROUP_NAMES`; ``None`` where this
        rank is not a member), e.g. ``{"world": "nccl", "background": "gloo", ...}`` (``dist.get_backend``: an nccl
        group's gloo for CPU tensors is not named)."""
        out = {}
        for name, handles in self.groups.items():
            group = handles[0]
            out[name] = None if group is None else str(dist.get_backend(group))
        return out

    def describe(self) -> str:
        """A readable table of this rank's coordinates and groups."""
        split = ", ".join(
            f"chunk {p.exchange.chunk}/{p.exchange.num_chunks} with {list(p.exchange.ranks)}"
            for p in self.split_exchanges
        )
        rows = [
            ("rank", f"{self.rank} of {self.world_size} (node-local {self.local_rank} of {self.local_world_size})"),
            (
                "facility",
                f"{self.facility} of {self.num_facilities}, local rank {self.facility_rank} of {self.facility_size}",
            ),
            ("replica", f"{self.replica} of {self.num_replicas}"),
            ("shard", f"{self.shard} of {self.shard_size}"),
            ("mesh", f"{tuple(self.mesh.mesh_dim_names)} {self.mesh.mesh.tolist()}"),
            ("backend", f"{self.backend} on {self.device} (init on {self.init_device})"),
            ("streams", f"{self.num_streams} ({'cuda' if self.streams else 'async collectives on CPU'})"),
            ("peers", split or "none (single facility)"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def resolve_backend(backend: str, cuda_available: bool | None = None, local_world_size: int = 1) -> str:
    """The device backend of ``distributed.backend``: ``auto`` is nccl where each of ``local_world_size``
    processes on this node has a GPU, else gloo (:func:`~.device.choose_backend`); ``cuda_available`` given:
    nccl where it is true."""
    if backend != "auto":
        return backend
    if cuda_available is not None:
        return "nccl" if cuda_available else "gloo"
    return choose_backend("auto", local_world_size).backend


def group_backend(backend: str) -> str:
    """The backend string of every process group for device backend ``backend``.

    On nccl the groups also get gloo for CPU tensors: the loss table, the round times and the
    phase table are small CPU tensors, which an nccl-only group cannot reduce.
    """
    return "cpu:gloo,cuda:nccl" if backend == "nccl" else backend


def init_default_group(env: ProcessEnv, backend: str = "auto", timeout_s: float = 300.0) -> torch.device:
    """Set this process's device, then initialise the default process group; return the device.

    The device is set first so that NCCL's communicators bind to this rank's GPU (not GPU 0). ``auto`` is
    :func:`~.device.choose_backend`'s choice for this node (nccl only with one GPU per process).
    """
    backend = resolve_backend(backend, local_world_size=env.local_world_size)
    device = cuda_device(env.local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        cuda_defaults(device)
    if env.master_addr is not None:
        os.environ.setdefault("MASTER_ADDR", env.master_addr)
    if env.master_port is not None:
        os.environ.setdefault("MASTER_PORT", str(env.master_port))
    dist.init_process_group(
        backend=group_backend(backend),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
        store=elastic_store(env, timedelta(seconds=timeout_s)),
    )
    return device


def _new_groups(ranks: tuple[int, ...], num_streams: int, backend: str, timeout: timedelta):
    # Every rank must call new_group for every group, in the same order.
    return tuple(dist.new_group(list(ranks), backend=backend, timeout=timeout) for _ in range(num_streams))


def _join_default_group(env: ProcessEnv, backend: str, timeout_s: float) -> torch.device:
    """This rank's device, once the default process group exists with the job's timeout."""
    if not dist.is_initialized():
        return init_default_group(env, backend, timeout_s)
    # Under torchrun the group exists (made before the config was known): apply the timeout now.
    device = cuda_device(env.local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        cuda_defaults(device)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))
    return device


def _facility_groups(layout: Layout, num_streams: int, backend: str, timeout: timedelta):
    """Every facility's groups, by facility: the whole facility, its shard groups (one FSDP sharding)
    and its replica groups (same shard, all replicas); built by every rank in the same order."""
    facility_groups, shard_groups, replica_groups = {}, {}, {}
    for f in range(layout.num_facilities):
        facility_groups[f] = _new_groups(layout.facility_ranks(f), num_streams, backend, timeout)
        for r in range(layout.replicas[f]):
            shard_groups[(f, r)] = _new_groups(layout.shard_group_ranks(f, r), 1, backend, timeout)
        for s in range(layout.shard_size):
            replica_groups[(f, s)] = _new_groups(layout.replica_group_ranks(f, s), num_streams, backend, timeout)
    return facility_groups, shard_groups, replica_groups


def _peer_exchanges(
    plan: tuple[Exchange, ...], rank: int, num_streams: int, backend: str, timeout: timedelta
) -> tuple[PeerExchange, ...]:
    """The exchanges of ``plan`` that ``rank`` joins (every rank builds the groups of every exchange)."""
    out = []
    for ex in plan:
        groups = _new_groups(ex.ranks, num_streams, backend, timeout)
        if rank in ex.ranks:
            out.append(PeerExchange(ex, groups))
    return tuple(out)


def _device_mesh(layout: Layout, coords: Coords, replica_pg, shard_pg, device: torch.device) -> DeviceMesh:
    """The facility's mesh for FSDP: ``(replicate, shard)`` for HSDP with more than one replica, else ``(shard,)``."""
    f = coords.facility
    if layout.replicas[f] == 1:
        return DeviceMesh.from_group(shard_pg, device.type, mesh_dim_names=("shard",))
    mesh_ranks = torch.tensor(layout.facility_ranks(f), dtype=torch.int).view(layout.replicas[f], layout.shard_size)
    return DeviceMesh.from_group(
        [replica_pg, shard_pg],
        device.type,
        mesh=mesh_ranks,
        mesh_dim_names=("replicate", "shard"),
    )


def _overlap_groups(layout: Layout, coords: Coords, backend: str, timeout: timedelta) -> dict[str, tuple]:
    """Groups no one else uses: the overlapped exchange runs beside the training thread's collectives."""
    first = {
        s_: _new_groups(
            tuple(layout.facility_offsets[g] + s_ for g in range(layout.num_facilities)), 1, backend, timeout
        )
        for s_ in range(layout.shard_size)
    }
    replicas = {
        (g, s_): _new_groups(layout.replica_group_ranks(g, s_), 1, backend, timeout)
        for g in range(layout.num_facilities)
        for s_ in range(layout.shard_size)
    }
    return {
        "overlap_peers": first[coords.shard] if coords.replica == 0 else (None,),
        "overlap_replicas": replicas[(coords.facility, coords.shard)],
    }


def build_state(
    layout: Layout,
    env: ProcessEnv,
    *,
    backend: str = "auto",
    num_streams: int = 1,
    timeout_s: float = 300.0,
    overlap: bool = False,
) -> DistributedState:
    """Initialise the default process group (if needed) and every group of ``layout``
    (:data:`GROUP_NAMES`; ``overlap``: also the groups of an exchange overlapping local steps)."""
    if env.world_size != layout.world_size:
        raise ValueError(f"the launcher started {env.world_size} processes but the layout plans {layout.world_size}")
    if num_streams < 1:
        raise ValueError(f"strategy.streams={num_streams}: need at least one stream")
    backend = resolve_backend(backend, local_world_size=env.local_world_size)
    timeout = timedelta(seconds=timeout_s)
    device = _join_default_group(env, backend, timeout_s)
    pg_backend = group_backend(backend)
    coords = layout.coords(env.rank)

    # Every rank creates every group, in this order.
    facility_groups, shard_groups, replica_groups = _facility_groups(layout, num_streams, pg_backend, timeout)
    split, sender = (), ()
    if layout.num_facilities > 1:
        split = _peer_exchanges(layout.split_exchanges(), env.rank, num_streams, pg_backend, timeout)
        sender = _peer_exchanges(layout.sender_exchanges(), env.rank, num_streams, pg_backend, timeout)
    f, r, s = coords.facility, coords.replica, coords.shard
    shard_pg = shard_groups[(f, r)][0]
    mesh = _device_mesh(layout, coords, replica_groups[(f, s)][0], shard_pg, device)
    # Built after the mesh.
    peers = {s_: _new_groups(layout.peer_ranks(s_), 1, pg_backend, timeout) for s_ in range(layout.shard_size)}
    background = _new_groups(tuple(range(layout.world_size)), 1, "gloo", timeout)
    groups = {
        "world": (dist.group.WORLD,),
        "facility": facility_groups[f],
        "replica": replica_groups[(f, s)],
        "shard": (shard_pg,),
        "peers": peers[s],
        "senders": sender[0].groups if sender and r == 0 else (None,),
        "background": background,
    }
    if overlap:
        groups.update(_overlap_groups(layout, coords, pg_backend, timeout))

    streams = tuple(torch.cuda.Stream(device=device) for _ in range(num_streams)) if device.type == "cuda" else ()
    return DistributedState(
        layout=layout,
        env=env,
        coords=coords,
        backend=backend,
        device=device,
        init_device=torch.device("cpu"),
        mesh=mesh,
        groups=MappingProxyType(groups),
        split_exchanges=split,
        sender_exchanges=sender,
        streams=streams,
        num_streams=num_streams,
    )
