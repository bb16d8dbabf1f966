"""Functions run inside spawned workers by the multi-process tests (importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def state_membership(federated, hsdp, streams):
    """Report this rank's groups, and prove each one carries traffic among exactly its members."""
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state, read_env

    env = read_env()
    state = build_state(plan_layout(env.world_size, federated, hsdp), env, num_streams=streams)

    def ranks_and_sum(group):
        t = torch.tensor([float(state.rank)])
        dist.all_reduce(t, group=group)
        return tuple(dist.get_process_group_ranks(group)), int(t.item())

    out = {
        "coords": (state.facility, state.facility_rank, state.replica, state.shard),
        "mesh": state.mesh.mesh.tolist(),
        "mesh_dims": tuple(state.mesh.mesh_dim_names),
        "facility": [ranks_and_sum(g) for g in state.facility_groups],
        "replica": [ranks_and_sum(g) for g in state.replica_groups],
        "split": [(p.exchange.chunk, [ranks_and_sum(g) for g in p.groups]) for p in state.split_exchanges],
        "sender": [[ranks_and_sum(g) for g in p.groups] for p in state.sender_exchanges],
        "describe": state.describe(),
    }
    dist.destroy_process_group()
    return out


def facility_values(rank: int, shape=(6, 5)) -> torch.Tensor:
    """Deterministic per-rank values; replicas of one facility agree (they are one model)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + rank))


def reference_average(federated, hsdp, weight_cases):
    """Shard a small model, give each facility different values, average with each of
    ``weight_cases``; report the local shards after each."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from xffl_like.aggregation.reference import ReferenceAverage
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state, read_env

    env = read_env()
    state = build_state(plan_layout(env.world_size, federated, hsdp), env)
    model = nn.Sequential(nn.Linear(5, 6, bias=True), nn.Linear(6, 3, bias=False))
    fully_shard(model, mesh=state.mesh)
    average = ReferenceAverage(state)
    first = state.layout.facility_offsets[state.facility]  # facility's values: seeded by its first rank
    out = []
    for weights in weight_cases:
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                full = facility_values(first * 10 + i, p.shape)
                p.to_local().copy_(torch.chunk(full, state.shard_size)[state.shard])
        average(model, weights)
        out.append([p.to_local().detach().clone() for p in model.parameters()])
    dist.destroy_process_group()
    return state.shard, state.shard_size, out
