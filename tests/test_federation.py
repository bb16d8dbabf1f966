"""Federated algorithms: options and the codec path without processes, then every algorithm on
4 gloo processes (three layouts) against computations done in the workers by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from xffl_like.distributed.launch import launch_local
from xffl_like.distributed.layout import plan_layout
from xffl_like.federation import CompressedMean, FederationOptions, validate_federation

import federation_workers as workers

CONF = Path(__file__).parents[1] / "conf"


# ----------------------------------------------------------------------------- pure
def test_presets_compose():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        default = compose(config_name="config")
        diloco = compose(config_name="config", overrides=["federation=diloco"])
        fedavg = compose(config_name="config", overrides=["federation=fedavg"])
    from omegaconf import OmegaConf

    layout = plan_layout(4, 2, None)
    plain = lambda c: OmegaConf.to_container(c.federation, resolve=True)  # noqa: E731 - what workers get
    d = validate_federation(plain(diloco), layout)
    assert (d.outer.name, d.outer.lr, d.outer.momentum, d.algorithm) == ("nesterov", 0.7, 0.9, "federated")
    f = validate_federation(plain(fedavg), layout)
    assert f.outer.is_plain_mean and f == validate_federation(plain(default), layout)


@pytest.mark.parametrize("override, layout, message", [
    (dict(algorithm="async"), (4, 2), "federation.algorithm='async': use federated or synchronous"),
    (dict(outer=dict(name="sgd")), (4, 2), "federation.outer.name='sgd': use one of average, nesterov"),
    (dict(outer=dict(name="average", lr=-1)), (4, 2), "federation.outer.lr=-1: must be a number in (0.0, inf)"),
    (dict(outer=dict(name="nesterov", lr=0.7, momentum=0)), (4, 2), "needs federation.outer.momentum > 0"),
    (dict(outer=dict(name="adam", betas=[0.9])), (4, 2), "federation.outer.betas=[0.9]: must be two numbers"),
    (dict(compression="int4"), (4, 2), "federation.compression='int4': use one of none, bf16, uint8"),
    (dict(compression="uint8", chunk_size=0), (4, 2), "federation.chunk_size=0: must be a positive integer"),
    (dict(error_feedback=True), (4, 2), "federation.error_feedback=true needs federation.compression"),
    (dict(topology="ring"), (3, 1, None), "federation.topology=ring across 3 facilities: topology 'ring' needs an even number of facilities"),
    (dict(topology="one-peer-exp"), (6, 1, None), "needs a power-of-two number of facilities, got 6"),
    (dict(topology="alternating-exp-ring"), (4, 2), "same number (>= 2) of replicas each"),
    (dict(topology="star"), (4, 2), "federation.topology='star': use one of complete, ring"),
    (dict(topology="ring", compression="uint8"), (4, 1), "compressed gossip is not supported"),
    (dict(topology="ring", weights="tokens"), (4, 1), "gossip mixes with the topology's own weights"),
    (dict(algorithm="synchronous", outer=dict(name="nesterov", lr=0.7, momentum=0.9)), (4, 2), "federation.outer does not apply"),
    (dict(weights=[1, 2, 3]), (4, 2), "a list of 2 non-negative numbers"),
])
def test_bad_options(override, layout, message):
    spec = workers.spec(**override)
    with pytest.raises(ValueError) as err:
        validate_federation(spec, plan_layout(*layout) if len(layout) == 3 else plan_layout(layout[0], layout[1], None))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_alternating_exp_ring_accepts_hsdp_facilities():
    opts = validate_federation(workers.spec(topology="alternating-exp-ring"), plan_layout(4, 2, 1))
    assert isinstance(opts, FederationOptions) and opts.topology == "alternating-exp-ring"


@pytest.mark.parametrize("kind", ["uint8", "bf16"])
def test_error_feedback_carries_the_residual(kind):
    """Each round sends update + the last residual, and keeps what that message lost: over
    several rounds what was sent adds up to what was meant minus the final residual, and the
    residual is within half a quantization step of each chunk (uint8)."""
    torch.manual_seed(0)
    numel, n, chunk = 1000, 2, 64
    comp = CompressedMean(kind, numel, n, chunk_size=chunk, error_feedback=True)
    meant = torch.zeros(numel, dtype=torch.float64)
    sent = torch.zeros(numel, dtype=torch.float64)
    previous = torch.zeros(numel)
    for r in range(4):
        update = torch.randn(numel) * (r + 1)
        meant += update.double()
        carried = update + previous  # what this round must send: the update plus the last residual
        message = comp.prepare(update.clone())
        decoded = comp.decode(message).view(-1)[:numel]
        sent += decoded.double()
        assert torch.allclose(comp.residual, carried - decoded, atol=1e-6)
        if kind == "uint8":
            bound = workers.split_bounds(carried.double(), n, chunk)
            assert bool((comp.residual.double().abs() <= bound + 1e-6).all())
            assert message.dtype == torch.uint8 and message.shape[1] == comp.row_bytes
        else:
            assert bool((comp.residual.abs() <= carried.abs() * 2**-8 + 1e-12).all())
        previous = comp.residual.clone()
    assert torch.allclose(sent, meant - comp.residual.double(), atol=1e-4)
    comp_off = CompressedMean(kind, numel, n, chunk_size=chunk)
    assert comp_off.residual is None


# ----------------------------------------------------------------------------- multi-process
LAYOUTS = [
    # 2 facilities x FSDP over 2 ranks: outer optimizers, plain mean, compression, synchronous.
    dict(name="fsdp_2x2", federated=2, hsdp=None, checks=["outer", "plain", "compression", "synchronous"]),
    # 2 facilities x 2 replicas (HSDP): the replicas' hand-over, alternating-exp-ring.
    dict(name="hsdp_2x2", federated=2, hsdp=1, checks=["outer", "gossip", "compression", "synchronous"]),
    # 4 facilities of one rank: gossip over ring / one-peer-exp / complete, compression among 4.
    dict(name="four_facilities", federated=1, hsdp=None, checks=["plain", "gossip", "compression"]),
]


def test_federation_on_4_processes():
    reports = launch_local(workers.run_layouts, (LAYOUTS,), 4)
    by = {name: [r[name] for r in reports] for name in (lay["name"] for lay in LAYOUTS)}
    assert all(r["outer_cases"] == 4 * 2 * 2 and r["sync_cases"] == 2 for r in by["fsdp_2x2"] + by["hsdp_2x2"])
    assert all(r["plain_cases"] == 3 for r in by["fsdp_2x2"] + by["four_facilities"])
    assert all(r["gossip_cases"] == 2 * 2 for r in by["hsdp_2x2"])  # ring, alternating-exp-ring; two outer rules
    assert all(r["gossip_cases"] == 3 * 2 for r in by["four_facilities"])
    assert all(r["compression_cases"] == 4 for rs in by.values() for r in rs)
    # Bytes counted from the messages: 2 facilities, the wide model, every rank sends.
    for r in by["fsdp_2x2"]:
        sent = r["compressed_bytes"]
        assert sent["none"] > 0 and sent["uint8"] <= 0.27 * sent["none"] and sent["bf16"] <= 0.51 * sent["none"], sent
    # HSDP: only the first replica of each facility crosses the boundary.
    assert sorted(r["compressed_bytes"]["uint8"] > 0 for r in by["hsdp_2x2"]) == [False, False, True, True]


def test_job_with_diloco_and_uint8(tmp_path):
    """The main job wires the federation in: DiLoCo rounds over a compressed exchange with error
    feedback and token weights leave every copy identical, and about a quarter of fp32's bytes cross."""
    import json

    import yaml
    from test_run import TINY, run_cli

    from xffl_like.models import build_model

    args = ["+experiment=llama_fed", "distributed.nproc_per_node=2", "distributed.federated=1", "train.steps=4",
            "federation.every=2", "federation=diloco", "federation.compression=uint8", "federation.error_feedback=true",
            "federation.weights=tokens", "logger=none", *TINY]
    proc, _ = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["federation"] == {"algorithm": "federated", "every": 2, "topology": "complete", "outer": "nesterov",
                                     "outer_lr": 0.7, "compression": "uint8"}
    assert summary["layout"]["facility_sizes"] == [1, 1] and summary["rounds"] == 2
    assert summary["max_param_divergence_after_last_round"] == 0.0
    model = build_model(yaml.safe_load((tmp_path / "config.yaml").read_text())["model"], device="meta")
    fp32 = 2 * 4 * sum(p.numel() for p in model.parameters())  # both facilities send one fp32 copy
    sent = summary["cross_facility_bytes_per_round"]
    assert all(0.24 * fp32 <= b <= 0.27 * fp32 for b in sent), (sent, fp32)
