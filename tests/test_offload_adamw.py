"""``parallel.cpu_offload``: AdamW steps the host's shards with torch's fused CPU kernel (issue 40 item 4); a job
without offload keeps what it had (foreach on the CPU, fused on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from xffl_like.config.schema import OptimConfig
from xffl_like.train import sync
from xffl_like.train.optim import build_optimizer
from xffl_like.train.speed import fused_adamw

ADAMW = OptimConfig.from_mapping({"name": "adamw", "lr": 1e-3})


def test_offloaded_parameters_get_fused_cpu_adamw():
    assert fused_adamw([torch.zeros(2), torch.zeros(3)], offload=True)
    assert not fused_adamw([torch.zeros(2)])  # no offload: the CPU keeps foreach, its figures unchanged
    model = torch.nn.Linear(2, 2)
    opt = build_optimizer(model, ADAMW, offload=True)
    assert opt.defaults["fused"]
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.detach().clone()
    opt.step()  # the fused CPU kernel runs on this torch
    assert not torch.equal(before, model.weight)


@pytest.mark.parametrize("offload", [False, True])
def test_the_job_passes_its_offload_to_the_optimizer(monkeypatch, offload):
    seen = {}
    monkeypatch.setattr(sync, "build_sharded_model", lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setattr(sync, "contiguous_shards", lambda *a: None)
    monkeypatch.setattr(sync, "compiles", lambda *a: False)
    real = sync.build_optimizer
    monkeypatch.setattr(sync, "build_optimizer", lambda m, c, offload=False: seen.update(o=offload) or real(m, c))
    cfg = SimpleNamespace(
        train=SimpleNamespace(dtype="float32", compile=False), model=None, seed=0, optim=ADAMW,
        parallel=SimpleNamespace(cpu_offload=offload),
    )  # fmt: skip
    sync.ShardedParts.build(cfg, SimpleNamespace(device=torch.device("cpu"), shard_size=1), steps=4)
    assert seen == {"o": offload}
