"""The plain reference average across facilities: correct, simple, not fast.

Every rank holding shard ``s`` (all replicas of all facilities) joins one all-reduce
per parameter. Replicas inside a facility hold identical values, so each rank scales
its contribution by ``w_f / (R_f * sum(w))``: the sum is then the weighted mean over
facilities, on any backend (gloo has no AVG). The strategies in this package must
agree with it; the tests use it as an independent check.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..distributed.state import DistributedState

__all__ = ["ReferenceAverage", "all_peer_groups", "facility_scale"]


def facility_scale(state: DistributedState, weights: Sequence[float] | None) -> float:
    """This facility's share of the mean: ``w_f / sum(w)``."""
    if weights is None:
        return 1.0 / state.num_facilities
    if len(weights) != state.num_facilities or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"need {state.num_facilities} non-negative facility weights with a positive sum, got {list(weights)}")
    return float(weights[state.facility]) / float(sum(weights))


def all_peer_groups(state: DistributedState) -> list:
    """One group per shard index holding every rank of every facility with that shard.

    Collective: every rank creates every group, in the same order.
    """
    return [dist.new_group(list(state.layout.peer_ranks(s))) for s in range(state.shard_size)]


class ReferenceAverage:
    """Averages every parameter's local shard across facilities, in place (float64 sums).

    Construct on every rank at the same point (it creates one group per shard index).
    """

    def __init__(self, state: DistributedState):
        self.state = state
        self.group = all_peer_groups(state)[state.shard]

    @torch.no_grad()
    def __call__(self, model: nn.Module, weights: Sequence[float] | None = None) -> None:
        state = self.state
        if state.num_facilities == 1:
            return
        scale = facility_scale(state, weights) / state.num_replicas
        for param in model.parameters():
            local = param.to_local() if hasattr(param, "to_local") else param
            buf = local.detach().to(torch.float64) * scale
            dist.all_reduce(buf, group=self.group)
            local.copy_(buf.to(local.dtype))
