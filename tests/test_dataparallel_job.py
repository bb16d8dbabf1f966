"""Tier 3: the main job with ``parallel=decentralized`` and ``parallel=bagua`` (the CLI in a subprocess).

The expected values are computed here, in one process, from the equations: four copies of
the tiny Llama trained with SGD on each rank's batches, mixed over the ring written out by
hand (Decent-DP), or averaged by hand (Bagua's gradient all-reduce, ``switch_to``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from helpers import TINY, run_cli

from xffl_like.config.schema import job_config
from xffl_like.config.validate import ConfigError, validate_config
from xffl_like.job import _compose, choices, resolve

SGD = ["optim=sgd", "optim.lr=0.1", "optim.momentum=0.0", "optim.warmup_steps=0", "optim.grad_clip=0.0", "logger=none"]
RING = [[(0, 1), (2, 3)], [(0, 3), (1, 2)]]  # Decent-DP's ring on 4 ranks: right neighbours, then left


def _run(args, tmp_path):
    run_dir = tmp_path / "run"
    proc, _ = run_cli(
        [*args, *TINY, *SGD, "train.log_every=1"],
        run_dir,
        env={"XFFL_TEST_DUMP_ROUNDS": str(tmp_path / "rounds")},
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    return cfg, json.loads((run_dir / "summary.json").read_text()), run_dir


def _dump(tmp_path: Path, index: int, phase: str, rank: int) -> list[torch.Tensor]:
    record = torch.load(tmp_path / "rounds" / f"round{index:03d}_{phase}_rank{rank:03d}.pt", weights_only=True)
    return list(record["params"].values())


class Copies:
    """Each rank's data and a model to take gradients with, built from the run's resolved config."""

    def __init__(self, cfg: dict, facilities: list[int]):
        from xffl_like.config.schema import DataConfig
        from xffl_like.data import build_data
        from xffl_like.models import LlamaConfig, build_model

        self.model = build_model(LlamaConfig.from_mapping(cfg["model"]), seed=cfg["seed"])
        self.x0 = [p.detach().clone() for p in self.model.parameters()]
        t = cfg["train"]
        self.data, self.loss_chunk = [], t["loss_chunk"]
        for f, size in enumerate(facilities):
            for r in range(size):
                self.data.append(
                    build_data(
                        DataConfig(**cfg["data"]),
                        vocab_size=cfg["model"]["vocab_size"],
                        seq_len=t["seq_len"],
                        batch_size=t["batch_size"],
                        seed=cfg["seed"],
                        facility=f,
                        num_facilities=len(facilities),
                        facility_rank=r,
                        facility_size=size,
                    )
                )

    def grad(self, rank: int, params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
        """The gradient of rank ``rank``'s batch of (1-based) ``step`` at ``params``."""
        with torch.no_grad():
            for p, v in zip(self.model.parameters(), params):
                p.copy_(v)
        self.model.zero_grad(set_to_none=True)
        inputs, targets = self.data[rank].train_batch(step - 1)
        self.model(inputs, targets, loss_chunk=self.loss_chunk).backward()
        return [p.grad.detach().clone() for p in self.model.parameters()]


def _distance(copies: list[list[torch.Tensor]]) -> float:
    flat = [torch.cat([t.reshape(-1) for t in c]).double() for c in copies]
    mean = sum(flat) / len(flat)
    return sum(float(torch.linalg.vector_norm(f - mean)) for f in flat) / len(flat)


@pytest.mark.cli
@pytest.mark.slow
def test_decentralized_job_equals_a_simulation_of_ring_gossip(tmp_path):
    steps, lr = 4, 0.1
    cfg, summary, run_dir = _run(["+experiment=decentralized", f"train.steps={steps}"], tmp_path)
    sim = Copies(cfg, [4])
    # Decent-DP: y_1 = x0 - lr g_1(x0); y_t = mix_{E_{t-1}}(y_{t-1}) - lr g_t(y_{t-1}); the update of step t
    # is applied during step t + 1's forward/backward, so after step 1 the copies still hold x0.
    ys = [[p - lr * g for p, g in zip(sim.x0, sim.grad(r, sim.x0, 1))] for r in range(4)]
    seen = {1: [sim.x0] * 4}
    for t in range(2, steps + 1):
        mixed = [None] * 4
        for a, b in RING[(t - 1) % 2]:
            mixed[a] = mixed[b] = [(u + v) / 2 for u, v in zip(ys[a], ys[b])]
        ys = [[m - lr * g for m, g in zip(mixed[r], sim.grad(r, ys[r], t))] for r in range(4)]
        seen[t] = ys
    for r in range(4):  # the copies as trained (before the final mean)
        for got, want in zip(_dump(tmp_path, 0, "before", r), ys[r]):
            assert torch.allclose(got, want, atol=2e-5), r
    assert not torch.allclose(ys[0][0], ys[1][0])  # a ring is not an all-reduce: the copies differ
    logged = {c["step"]: c["distance"] for c in summary["consensus_distance"]}
    assert sorted(logged) == list(range(1, steps + 1))
    for t, copies in seen.items():
        assert logged[t] == pytest.approx(_distance(copies), rel=1e-3, abs=1e-6), t
    assert summary["final_consensus_distance"] == logged[steps] > 0
    # The end: every copy is the exact mean; same summary keys as parallel=fsdp.
    assert summary["max_param_divergence_after_last_round"] <= 1e-6
    assert summary["rounds"] == 0 and summary["layout"]["shard_size"] == 1
    assert summary["parallel"]["name"] == "decentralized" and summary["parallel"]["topology"] == "ring"
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["consensus_distance"] for x in lines] == [logged[t] for t in range(1, steps + 1)]


@pytest.mark.cli
@pytest.mark.slow
def test_bagua_switch_job_on_unequal_facilities(tmp_path):
    """Facilities [3, 1] are the nodes: hierarchical gradient all-reduce, then shift_one gossip, then
    hierarchical gossip (node means weighted by size); every switch starts all copies from the mean."""
    lr = 0.1
    switch = (
        "parallel.switch=[{at_step:1,algorithm:decentralized,options:{peer_selection_mode:shift_one,"
        "hierarchical:false}},{at_step:3,algorithm:decentralized,options:{hierarchical:true}}]"
    )
    cfg, summary, _ = _run(
        [
            "+experiment=bagua_switch",
            "distributed.federated=[3,1]",
            "train.steps=5",
            "parallel.options={hierarchical:true}",
            switch,
        ],
        tmp_path,
    )
    sim = Copies(cfg, [3, 1])
    # Step 1, gradient all-reduce: x1 = x0 - lr * mean over the 4 ranks of g_r(x0), on every rank.
    grads = [sim.grad(r, sim.x0, 1) for r in range(4)]
    x1 = [p - lr * sum(g[k] for g in grads) / 4 for k, p in enumerate(sim.x0)]
    for r in range(4):
        for got, want in zip(_dump(tmp_path, 0, "before", r), x1):
            assert torch.allclose(got, want, atol=2e-5), r
    for index in (0, 1):  # after each switch: identical copies, equal to the mean of the copies before it
        before = [_dump(tmp_path, index, "before", r) for r in range(4)]
        mean = [sum(b[k] for b in before) / 4 for k in range(len(before[0]))]
        for r in range(4):
            for got, want, first in zip(_dump(tmp_path, index, "after", r), mean, _dump(tmp_path, index, "after", 0)):
                assert torch.equal(got, first) and torch.allclose(got, want, atol=1e-6)
    assert _distance([_dump(tmp_path, 1, "before", r) for r in range(4)]) > 1e-4  # shift_one let them drift
    logged = {c["step"]: c["distance"] for c in summary["consensus_distance"]}
    assert logged[1] < 1e-6 and logged[2] > 1e-4
    assert [s["algorithm"] for s in summary["parallel"]["switches"]] == ["decentralized", "decentralized"]
    assert summary["layout"]["facility_sizes"] == [3, 1] and summary["max_param_divergence_after_last_round"] <= 1e-6


# In-process (no workers): what the launcher refuses, one line each; the CLI path is in test_run.BAD.
REFUSED = [
    (["+experiment=bagua_switch", "federation=diloco"], "federation.outer (name='nesterov', lr=0.7) does not apply"),
    (["+experiment=decentralized", "federation.compression=uint8"], "federation.compression='uint8' does not apply"),
    (
        ["parallel.topology=complete"],
        "parallel.topology='complete' applies to parallel=decentralized, not parallel=fsdp",
    ),
    (["+experiment=decentralized", "parallel.switch=[{at_step:3,algorithm:bytegrad}]"], "applies to parallel=bagua"),
    (
        ["+experiment=decentralized", "distributed.nproc_per_node=3"],
        "parallel.topology=ring: topology 'ring' needs an even",
    ),
    (
        ["+experiment=decentralized", "parallel.topology=alternating-exp-ring", "distributed.federated=[3,1]"],
        "needs facilities (its nodes) of equal size, got [3, 1]",
    ),
    (
        ["+experiment=decentralized", "train.steps=1", "optim.warmup_steps=0"],
        "train.steps=1: parallel=decentralized applies",
    ),
    (["+experiment=decentralized", "parallel.optimizer=accum_adamw", "optim=sgd"], "select optim=adamw"),
    (["+experiment=decentralized", "distributed.max_restarts=1"], "distributed.max_restarts=1: restarts resume"),
    (["+experiment=bagua_switch", "train.grad_accum=2"], "train.grad_accum=2: parallel=bagua"),
    (["+experiment=bagua_switch", "parallel.algorithm=nope"], "parallel.algorithm='nope': use one of"),
    (["+experiment=bagua_switch", "parallel.switch=[{at_step:60,algorithm:bytegrad}]"], "at_step=60 is not before"),
    (
        [
            "+experiment=bagua_switch",
            "distributed.federated=[2,1,1]",
            "parallel.switch=[{at_step:3,algorithm:decentralized,options:{peer_selection_mode:shift_one}}]",
        ],
        "needs an even number of facilities (hierarchical: the nodes), got 3",
    ),
]


def _validate(overrides):
    composed = _compose(overrides)
    job = job_config(resolve(composed), choices(composed))
    n = job.distributed.nproc_per_node
    return validate_config(job, n, n, Path.cwd())


@pytest.mark.parametrize("overrides, needle", REFUSED, ids=[" ".join(r[0][1:]) or r[0][0] for r in REFUSED])
def test_launcher_refuses_combinations_that_make_no_sense(overrides, needle):
    with pytest.raises(ConfigError) as info:
        _validate(overrides)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_launcher_accepts_the_presets_with_full_copies():
    for preset in ("decentralized", "bagua_switch"):
        job, layout = _validate([f"+experiment={preset}"])
        assert layout.shard_size == 1 and job.distributed.hsdp == 1 and layout.facility_sizes == (4,)
    _, layout = _validate(
        ["+experiment=bagua_switch", "distributed.federated=[3,1]", "parallel.options={hierarchical:true}"]
    )
    assert layout.facility_sizes == (3, 1)
