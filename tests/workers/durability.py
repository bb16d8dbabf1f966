"""Functions run inside spawned workers by tests/test_durability.py (importable by name)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from xffl_like.config.schema import StrategyConfig

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


def staged_on_host():
    """Staging for async saves and the federation's DTensors, on one rank. The parameters are CPU tensors
    under a ``meta`` device mesh: as a GPU job's are GPU tensors under a ``cuda`` mesh, the mesh's device
    type is not the tensors', so a ``DTensor.from_local`` that moves the local tensor to the mesh's
    device shows on CPU. Returns what the test checks."""
    import tempfile
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from xffl_like.checkpoint.staging import HostStager, dtensor_over, host_copy
    from xffl_like.federation.federation import Federation

    dist.init_process_group("gloo")
    mesh = DeviceMesh("meta", torch.arange(1), _init_backend=False)
    like = [DTensor.from_local(torch.empty(s, device="meta"), mesh, [Shard(0)]) for s in [(4, 3), (5,)]]
    live = {
        f"p{i}": dtensor_over(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)), p)
        for i, p in enumerate(like)
    }
    out: dict = {}
    staged = host_copy({"model": live, "step": torch.tensor(3)})
    out["staged"] = [
        (
            str(t._local_tensor.device),
            t.device_mesh.device_type,
            type(t).__name__,
            t._local_tensor.untyped_storage().data_ptr() == live[k]._local_tensor.untyped_storage().data_ptr(),
            torch.equal(t._local_tensor, live[k]._local_tensor),
        )
        for k, t in staged["model"].items()
    ]

    # The federation's flat buffer (federation.outer.offload=true: on CPU) wrapped without a copy.
    fake = SimpleNamespace(names=list(live), params=like, locals=[t._local_tensor for t in live.values()])
    fake._views = lambda flat: Federation._views(fake, flat)
    flat = torch.arange(17, dtype=torch.float32)
    wrapped = Federation._as_dtensors(fake, flat)
    out["wrapped"] = [
        (str(t._local_tensor.device), t._local_tensor.data_ptr() - flat.data_ptr(), tuple(t.shape))
        for t in wrapped.values()
    ]

    # An async save staged by HostStager, the live tensors changed at once, then restored bitwise.
    saved = {k: v._local_tensor.clone() for k, v in live.items()}
    with tempfile.TemporaryDirectory() as where:
        pending = dcp.async_save({"model": live}, storage_writer=dcp.FileSystemWriter(where), async_stager=HostStager())
        for v in live.values():
            v._local_tensor.add_(1.0)  # training goes on while the copy is written
        pending.result()
        target = {k: dtensor_over(torch.zeros_like(v._local_tensor), v) for k, v in live.items()}
        dcp.load({"model": target}, storage_reader=dcp.FileSystemReader(where))
    out["restored"] = [torch.equal(target[k]._local_tensor, saved[k]) for k in live]
    dist.destroy_process_group()
    return out
