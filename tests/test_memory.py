"""Issue 30 item 2: memory. Init holds one copy of the weights (``model.init=meta`` materialises the
local shards straight into ``contiguous_shards``' flat buffer), and ``parallel.cpu_offload`` (FSDP2's
``CPUOffloadPolicy``: validated here on CPU, exercised on a GPU when there is one)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch
from helpers import PYTHONPATH, REPO

from xffl_like.config.schema import ModelConfig
from xffl_like.config.validate import ConfigError, validate_config
from xffl_like.job import _compose, choices, resolve, typed_config
from xffl_like.models import build_model
from xffl_like.train import parallelize
from xffl_like.train.parallelize import build_sharded_model, contiguous_shards, shard_model

SMALL = dict(name="small", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim=160)


def local_storages(model) -> set[int]:
    return {p._local_tensor.untyped_storage().data_ptr() for p in model.parameters()}


def test_meta_init_is_born_contiguous_and_equals_the_full_init(gloo_world):
    """``model.init=meta`` lays the shards out in one flat buffer as it allocates them: ``contiguous_shards``
    then has nothing to move, FSDP's all-gather inputs are the buffer's views, and the values (and a step's
    update) are those of ``model.init=full`` moved by ``contiguous_shards``."""
    cfg = ModelConfig(**SMALL, tie_embeddings=True, init="meta")
    meta = build_sharded_model(cfg, gloo_world, seed=3)
    assert contiguous_shards(meta, gloo_world.shard_size) == 0
    assert len(local_storages(meta)) == 1
    groups = [m._get_fsdp_state()._fsdp_param_group for m in meta.modules() if isinstance(m, parallelize.FSDPModule)]
    fsdp = [p for group in groups for p in group.fsdp_params]
    assert fsdp and local_storages(meta) == {p._sharded_param_data.untyped_storage().data_ptr() for p in fsdp}

    full = build_sharded_model(ModelConfig(**SMALL, tie_embeddings=True, init="full"), gloo_world, seed=3)
    assert contiguous_shards(full, gloo_world.shard_size) > 0 and len(local_storages(full)) == 1
    assert contiguous_shards(full, gloo_world.shard_size) == 0  # already laid out: no second buffer
    tokens = torch.randint(0, SMALL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
    for model in (meta, full):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
    for (name, a), (_, b) in zip(meta.named_parameters(), full.named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name


PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile
    import torch, torch.distributed as dist
    from xffl_like.distributed.env import ProcessEnv
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state
    from xffl_like.config.schema import ModelConfig
    from xffl_like.train.parallelize import build_sharded_model, contiguous_shards

    def rss(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    state = build_state(plan_layout(1, 1, 1, 1), ProcessEnv(0, 1, 0, 1), backend="gloo")
    cfg = ModelConfig(**json.loads(sys.argv[1]))
    # a tiny model first, through the same path: what the first build loads lazily (kernels, a CUDA build's
    # libraries) is not counted as the weights' growth
    tiny = dict(json.loads(sys.argv[1]), dim=64, n_layers=1, vocab_size=256, ffn_dim=128)
    del_me = build_sharded_model(ModelConfig(**tiny), state, seed=0)
    contiguous_shards(del_me, state.shard_size)
    torch.optim.AdamW(del_me.parameters(), lr=1e-3)
    del del_me
    before = rss("VmRSS:")
    model = build_sharded_model(cfg, state, seed=0)  # what ShardedParts.build does
    contiguous_shards(model, state.shard_size)
    torch.optim.AdamW(model.parameters(), lr=1e-3)  # its state comes with the first step
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"weights": weights, "grew": rss("VmHWM:") - before}))
    dist.destroy_process_group()
    """
)


@pytest.mark.cli
def test_setup_holds_one_copy_of_the_weights(tmp_path):
    """The setup of a ~55M-parameter model (220 MB, ``model.init=meta``, as ``ShardedParts.build``): the
    process's peak resident memory grows by the weights plus a margin, never by two copies (the flat
    buffer of ``contiguous_shards`` beside the storage ``to_empty`` gave each shard: 2x, what issue 30 saw)."""
    shape = dict(SMALL, dim=512, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=32000, ffn_dim=1536, init="meta")
    proc = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, json.dumps(shape)],
        cwd=REPO, env={"PYTHONPATH": PYTHONPATH, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["weights"] > 200e6
    assert got["grew"] < 1.25 * got["weights"] + 48e6, got  # one copy (+ init scratch, allocator slack)


# ----------------------------------------------------------------------------- parallel.cpu_offload
@pytest.mark.parametrize("offload", [False, True])
def test_cpu_offload_reaches_every_fully_shard(monkeypatch, offload):
    """``shard_model(offload=True)``: every ``fully_shard`` (each block, then the root) gets
    ``CPUOffloadPolicy(pin_memory=True)``; without it, the default ``OffloadPolicy`` (none)."""
    calls = []
    monkeypatch.setattr(parallelize, "fully_shard", lambda module, **kw: calls.append((module, kw)))
    model = build_model(ModelConfig(**SMALL), device="meta")
    shard_model(model, SimpleNamespace(mesh="facility-mesh", shard_size=2), offload=offload)
    assert [m for m, _ in calls] == [*model.layers, model]
    for _, kw in calls:
        policy = kw["offload_policy"]
        assert kw["mesh"] == "facility-mesh"
        assert isinstance(policy, parallelize.CPUOffloadPolicy) == offload
        assert not offload or policy.pin_memory


def test_cpu_offload_meta_init_pins_the_flat_buffer(monkeypatch):
    """With offload, ``model.init=meta`` materialises the parameters in pinned host memory (FSDP2 would
    otherwise copy each unpinned shard to its own pinned tensor, splitting the flat buffer)."""
    seen = {}
    model = SimpleNamespace(init_weights=lambda seed: seen.update(seed=seed))
    monkeypatch.setattr(parallelize, "build_model", lambda cfg, device: seen.update(device=device) or model)
    monkeypatch.setattr(parallelize, "shard_model", lambda model, state, dtype, offload: seen.update(offload=offload))
    monkeypatch.setattr(
        parallelize, "materialize_contiguous", lambda model, device, size, pin_memory: seen.update(pin=pin_memory)
    )
    state = SimpleNamespace(device=torch.device("cuda", 0), shard_size=4)
    assert build_sharded_model(ModelConfig(**SMALL, init="meta"), state, seed=7, offload=True) is model
    assert seen == {"device": "meta", "offload": True, "pin": True, "seed": 7}


def main_job(*overrides: str):
    composed = _compose(["+experiment=llama_fed", *overrides])
    return typed_config(resolve(composed), choices(composed))


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_cpu_offload_is_refused_on_a_cpu_job(monkeypatch):
    """Offload moves the shards off the GPU: a job on CPU is refused in one line, before any worker starts;
    with a GPU per process it is accepted."""
    fake_gpus(monkeypatch, 0)
    with pytest.raises(ConfigError, match=r"^parallel.cpu_offload=true .* runs on CPU .*parallel.cpu_offload=false\)$"):
        validate_config(main_job("parallel.cpu_offload=true"), 4, 4, REPO)
    validate_config(main_job(), 4, 4, REPO)  # the default: off
    fake_gpus(monkeypatch, 4)
    job, _ = validate_config(main_job("parallel.cpu_offload=true"), 4, 4, REPO)
    assert job.parallel.cpu_offload is True


@pytest.mark.parametrize("mode", ["decentralized", "bagua"])
def test_cpu_offload_is_fsdp_only(mode):
    with pytest.raises(ConfigError, match=rf"^parallel.cpu_offload=True applies to parallel=fsdp, not parallel={mode}"):
        validate_config(main_job(f"parallel={mode}", "parallel.cpu_offload=true"), 4, 4, REPO)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CPUOffloadPolicy needs a CUDA device")
def test_cpu_offload_on_a_gpu(tmp_path):
    """One rank on a GPU: the shards, their gradients and AdamW's state live in pinned host memory, in
    one flat buffer; a step runs and matches the same step without offload."""
    import torch.distributed as dist

    from xffl_like.distributed.env import ProcessEnv
    from xffl_like.distributed.layout import plan_layout
    from xffl_like.distributed.state import build_state

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        state = build_state(plan_layout(1, 1, 1, 1), ProcessEnv(0, 1, 0, 1), backend="nccl")
        tokens = torch.randint(0, SMALL["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(0))
        results = []
        for offload in (True, False):
            model = build_sharded_model(ModelConfig(**SMALL, init="meta"), state, seed=3, offload=offload)
            assert contiguous_shards(model, state.shard_size) == 0 and len(local_storages(model)) == 1
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            model(tokens.to(state.device)).float().logsumexp(-1).mean().backward()
            locals_ = [p._local_tensor for p in model.parameters()]
            if offload:
                assert all(t.device.type == "cpu" and t.is_pinned() for t in locals_)
                assert all(p.grad._local_tensor.device.type == "cpu" for p in model.parameters())
            opt.step()
            if offload:
                assert all(s.device.type == "cpu" for st in opt.state.values() for s in st.values() if s.dim())
            results.append([p._local_tensor.cpu() for p in model.parameters()])  # one rank: the whole tensor
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_forward_param_dtype_is_the_compute_dtype(gloo_world, dtype):
    """What bench.gpu's bf16 check reads (summary.json's ``forward_param_dtype``): the first block's parameters
    as the forward computes with them, while the stored shards stay float32."""
    model = build_sharded_model(ModelConfig(**SMALL, init="full"), gloo_world, dtype=dtype, seed=0)
    assert parallelize.forward_param_dtype(model) == dtype
    assert all(p.dtype == torch.float32 for p in model.parameters())
