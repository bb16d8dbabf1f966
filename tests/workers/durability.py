"""Functions run inside spawned workers by tests/test_durability.py (importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from xffl_like.schema import StrategyConfig

FUSED = StrategyConfig(name="fused", streams=1, bucket_mb=64, mode="split", only=None)


def facility_full_values(facility: int, index: int, shape) -> torch.Tensor:
    """Facility ``facility``'s full value of parameter ``index`` (the test recomputes them)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(100 * facility + index))


def nonfinite_round(weight_cases):
    """Three facilities of one rank; facility 1 holds a NaN. Report the fail-policy message and,
    for each of ``weight_cases``, the skip-policy result of one aggregation round."""
    from pathlib import Path

    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from xffl_like.aggregation import aggregate, build_strategy
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state, read_env
    from xffl_like.train.nonfinite import NonFiniteError, NonFiniteGuard

    env = read_env()
    state = build_state(plan_layout(env.world_size, 1, None), env)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Linear(6, 3, bias=False))
    fully_shard(model, mesh=state.mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    strategy = build_strategy(model, state, FUSED)

    def poison():
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.to_local().copy_(facility_full_values(state.facility, i, p.shape))
            if state.facility == 1:
                next(model.parameters()).to_local()[0, 0] = float("nan")

    out = {"skipped": [], "values": []}
    poison()
    try:
        NonFiniteGuard("fail", state, model, optimizer, Path("/nonexistent")).weights_for_round(None, 3, 8)
        out["fail"] = None
    except NonFiniteError as exc:
        out["fail"] = str(exc)
    skip = NonFiniteGuard("skip", state, model, optimizer, Path("/nonexistent"))
    for weights in weight_cases:
        poison()
        round_weights, skipped = skip.weights_for_round(weights, 3, 8)
        aggregate(strategy, state, round_weights)
        out["skipped"].append(skipped)
        out["values"].append([p.to_local().detach().clone() for p in model.parameters()])
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    dist.destroy_process_group()
    return out
