"""Functions run inside spawned workers by the multi-process tests (importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist


def state_membership(federated, hsdp, streams):
    """Report this rank's groups, and prove each one carries traffic among exactly its members."""
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state, read_env

    env = read_env()
    state = build_state(plan_layout(env.world_size, federated, hsdp), env, num_streams=streams, overlap=True)

    def ranks_and_sum(group):
        t = torch.tensor([float(state.rank)])
        dist.all_reduce(t, group=group)
        return tuple(dist.get_process_group_ranks(group)), int(t.item())

    out = {
        "coords": (state.facility, state.facility_rank, state.replica, state.shard),
        "mesh": state.mesh.mesh.tolist(),
        "mesh_dims": tuple(state.mesh.mesh_dim_names),
        "facility": [ranks_and_sum(state.group("facility", k)) for k in range(streams)],
        "replica": [ranks_and_sum(state.group("replica", k)) for k in range(streams)],
        "split": [(p.exchange.chunk, [ranks_and_sum(g) for g in p.groups]) for p in state.split_exchanges],
        "sender": [[ranks_and_sum(g) for g in p.groups] for p in state.sender_exchanges],
        "describe": state.describe(),
        # Every group by name: the members and a sum over them (None: this rank is no member).
        "named": {
            name: [
                None if state.group(name, k) is None else ranks_and_sum(state.group(name, k)) for k in range(streams)
            ]
            for name in (
                "world",
                "facility",
                "replica",
                "shard",
                "peers",
                "senders",
                "background",
                "overlap_peers",
                "overlap_replicas",
            )
        },
    }
    dist.destroy_process_group()
    return out
