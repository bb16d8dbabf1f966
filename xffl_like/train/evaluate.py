"""Held-out loss: when to evaluate, and each facility's mean.

Between aggregations each facility trains its own copy of the model. The loss of that local
copy right before an aggregation (``eval/loss_local``) and of the averaged model right after
(``eval/loss_global``), both on the facility's own held-out batches, show the federated gap:
what averaging costs (or gains) each facility.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from .parallelize import reshard_all

__all__ = ["eval_points", "evaluate", "facility_eval"]


def eval_points(done: int, boundary: bool, eval_every: int) -> bool:
    """Whether to evaluate the local model after ``done`` optimizer steps: every ``eval_every``
    steps (0: never on its own) and at each ``boundary`` (right before a round ends or, for
    ``synchronous``, every ``federation.every`` steps; see ``Federation.boundary_at``)."""
    return boundary or (eval_every > 0 and done % eval_every == 0)


@torch.no_grad()
def _mean_loss(model, batches, device, loss_chunk: int | None) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, targets in batches:
        total += model(inputs.to(device), targets.to(device), loss_chunk=loss_chunk).double()
    if isinstance(model, FSDPModule):
        # FSDP2 keeps the root's parameters gathered after a forward (a backward would follow in
        # training), and the blocks' on a one-rank shard group; without a backward they would stay
        # gathered, and stale once an aggregation changes the shards: the next forward and
        # ``model.parameters()`` would see old values.
        reshard_all(model)
    return total / max(1, len(batches))


def evaluate(model, batches, device, loss_chunk: int | None = None) -> float:
    """Mean loss over every rank's held-out ``batches`` (a collective over the default group)."""
    total = torch.stack(
        [
            _mean_loss(model, batches, device, loss_chunk) * len(batches),
            torch.tensor(float(len(batches)), dtype=torch.float64, device=device),
        ]
    )
    dist.all_reduce(total)
    return float(total[0] / total[1])


def facility_eval(model, batches, state, loss_chunk: int | None = None) -> list[float]:
    """Each facility's mean loss over its ranks' held-out ``batches`` (a collective over all ranks).

    Every rank gets the whole list, indexed by facility.
    """
    table = torch.zeros(state.num_facilities, dtype=torch.float64, device=state.device)
    table[state.facility] = _mean_loss(model, batches, state.device, loss_chunk) / state.facility_size
    dist.all_reduce(table)
    return table.tolist()
