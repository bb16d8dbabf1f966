"""FSDP2 on a shard group of one rank (issue 40 item 4): the blocks keep their gathered parameters from the forward
to the backward (``reshard_after_forward=False``: no second gather per block in backward), and an evaluation,
a forward with no backward, leaves every parameter sharded again (else stale after an aggregation)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributed.tensor import DTensor

from xffl_like.config.schema import ModelConfig
from xffl_like.train import parallelize
from xffl_like.train.evaluate import evaluate
from xffl_like.train.parallelize import build_sharded_model

SMALL = dict(name="small", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=160)


def _recording(monkeypatch, call_through: bool) -> list[tuple[str, object]]:
    calls = []
    real = parallelize.fully_shard

    def fully_shard(module, **kwargs):
        calls.append((type(module).__name__, kwargs.get("reshard_after_forward", "default")))
        return real(module, **kwargs) if call_through else module

    monkeypatch.setattr(parallelize, "fully_shard", fully_shard)
    return calls


def test_one_rank_blocks_do_not_reshard_after_forward(gloo_world, monkeypatch):
    calls = _recording(monkeypatch, call_through=True)
    build_sharded_model(ModelConfig(**SMALL), gloo_world, seed=0)
    assert gloo_world.shard_size == 1
    blocks, root = calls[:-1], calls[-1]
    assert len(blocks) == SMALL["n_layers"] and all(r is False for _, r in blocks), calls
    assert root[1] == "default"  # the root: FSDP2's own choice (it keeps its parameters for the backward)


def test_larger_shard_groups_keep_resharding(monkeypatch):
    calls = _recording(monkeypatch, call_through=False)
    model = parallelize.build_model(ModelConfig(**SMALL), seed=0)
    parallelize.shard_model(model, SimpleNamespace(mesh=None, shard_size=2))
    assert [r for _, r in calls[:-1]] == [True] * SMALL["n_layers"]


def test_an_evaluation_leaves_every_parameter_sharded(gloo_world):
    model = build_sharded_model(ModelConfig(**SMALL), gloo_world, seed=0)
    batch = torch.randint(0, SMALL["vocab_size"], (2, 8))
    model(batch, batch).backward()  # a training step's gather and free
    evaluate(model, [(batch, batch)], gloo_world.device)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    with torch.no_grad():  # an aggregation writes the shards: the next evaluation sees it
        before = evaluate(model, [(batch, batch)], gloo_world.device)
        for p in model.parameters():
            p.to_local().mul_(0.5)
        after = evaluate(model, [(batch, batch)], gloo_world.device)
    assert after != before
