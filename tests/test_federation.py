"""Federated algorithms: options and the codec path without processes, then every algorithm on
4 gloo processes (three layouts) against computations done in the workers by hand."""

from __future__ import annotations

import pytest
import torch
from helpers import CONF
from workers import federation as workers

from xffl_like.config.schema import FederationConfig, OuterConfig, as_plain, build_section
from xffl_like.distributed.launch import launch_local
from xffl_like.distributed.layout import plan_layout
from xffl_like.federation import CompressedMean, check_fragments, validate_federation


# ----------------------------------------------------------------------------- pure
def test_presets_compose():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        default = compose(config_name="config")
        diloco = compose(config_name="config", overrides=["federation=diloco"])
        fedavg = compose(config_name="config", overrides=["federation=fedavg"])
    from omegaconf import OmegaConf

    layout = plan_layout(4, 2, None)
    typed = lambda c: build_section(FederationConfig, OmegaConf.to_container(c.federation, resolve=True))  # noqa: E731
    d = typed(diloco)
    [phase] = validate_federation(d, layout)
    assert phase.config == d and not phase.scheduled
    assert (d.outer.name, d.outer.lr, d.outer.momentum, d.algorithm) == ("nesterov", 0.7, 0.9, "federated")
    f = typed(fedavg)
    validate_federation(f, layout)
    assert f.outer.is_plain_mean and f == typed(default) and isinstance(f.outer, OuterConfig)


@pytest.mark.parametrize(
    "override, layout, message",
    [
        (dict(algorithm="async"), (4, 2), "federation.algorithm='async': use federated or synchronous"),
        (dict(outer=dict(name="sgd")), (4, 2), "federation.outer.name='sgd': use one of average, nesterov"),
        (dict(outer=dict(name="average", lr=-1)), (4, 2), "federation.outer.lr=-1: must be a number in (0.0, inf)"),
        (dict(outer=dict(name="nesterov", lr=0.7, momentum=0)), (4, 2), "needs federation.outer.momentum > 0"),
        (dict(outer=dict(name="adam", betas=[0.9])), (4, 2), "federation.outer.betas=[0.9]: must be two numbers"),
        (dict(compression="int4"), (4, 2), "federation.compression='int4': use one of none, bf16, uint8"),
        (dict(compression="uint8", chunk_size=0), (4, 2), "federation.chunk_size=0: must be a positive integer"),
        (dict(error_feedback=True), (4, 2), "federation.error_feedback=true needs federation.compression"),
        (
            dict(topology="ring"),
            (3, 1, None),
            "federation.topology=ring across 3 facilities: topology 'ring' needs an even number of facilities",
        ),
        (dict(topology="one-peer-exp"), (6, 1, None), "needs a power-of-two number of facilities, got 6"),
        (dict(topology="alternating-exp-ring"), (4, 2), "same number (>= 2) of replicas each"),
        (dict(topology="star"), (4, 2), "federation.topology='star': use one of complete, ring"),
        (dict(topology="ring", compression="uint8"), (4, 1), "compressed gossip is not supported"),
        (dict(topology="ring", weights="tokens"), (4, 1), "gossip mixes with the topology's own weights"),
        (
            dict(algorithm="synchronous", outer=dict(name="nesterov", lr=0.7, momentum=0.9)),
            (4, 2),
            "federation.outer does not apply",
        ),
        (dict(weights=[1, 2, 3]), (4, 2), "a list of 2 non-negative numbers"),
    ],
)
def test_bad_options(override, layout, message):
    spec = workers.spec(**override)
    with pytest.raises(ValueError) as err:
        validate_federation(spec, plan_layout(*layout) if len(layout) == 3 else plan_layout(layout[0], layout[1], None))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_alternating_exp_ring_accepts_hsdp_facilities():
    [phase] = validate_federation(workers.spec(topology="alternating-exp-ring"), plan_layout(4, 2, 1))
    assert isinstance(phase.config, FederationConfig) and phase.config.topology == "alternating-exp-ring"


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


def test_every_s_round_ends_when_another_facility_reaches_train_steps():
    """``federation.every_s``: a facility that will reach train.steps early in the next round makes that
    round end then for the others (they would otherwise train on for the rest of every_s while it waits).
    One rank per facility (no collective inside a facility); the clock is set by hand."""
    from types import SimpleNamespace

    from xffl_like.federation import pace

    clock = [0.0]  # the paces' clock, given through their constructor

    def a_round(p, first, step):
        """Steps of ``first`` s (the first, with the evaluation) then ``step`` s until the facility is due:
        (steps taken, seconds from the round's start to its end)."""
        begin, done, at = clock[0], p.taken, clock[0] + first
        while True:
            clock[0] = at
            p.step_taken()
            done += 1
            if p.due(done):
                return done - p.first, clock[0] - begin
            at += step

    cfg = FederationConfig(every=None, every_s=10.0)
    pace_of = {0: (1.5, 0.5), 1: (2.0, 1.0)}  # facility 1 twice as slow
    state = [SimpleNamespace(facility=f, facility_size=1) for f in (0, 1)]
    paces = [pace.RoundPace(cfg, state[f], 40, now=lambda: clock[0]) for f in (0, 1)]
    assert paces[0].seconds_to_cap(0) == float("inf")  # nothing timed yet
    for p in paces:
        p.start(0)
    ends, taken = [], []
    for limits in ([10.0, 10.0], [10.0, 10.0], [10.0, 3.0]):
        assert [p.limit for p in paces] == limits
        rounds = []
        for f, p in enumerate(paces):
            clock[0] = 1000.0 * len(ends)  # every facility starts the round at the same time
            rounds.append(a_round(p, *pace_of[f]))
        taken.append([n for n, _ in rounds])
        ends.append([t for _, t in rounds])
        to_cap = [p.seconds_to_cap(p.taken) for p in paces]
        clock[0] = 1000.0 * len(ends)
        for p in paces:
            p.round_done(p.taken, to_cap)
    # Rounds 1 and 2 of every_s = 10 s (another step would end past it): 18 fast steps (1.5 + 17 x 0.5), 9 slow ones.
    assert taken[:2] == [[18, 9], [18, 9]] and ends[:2] == [[10.0, 10.0], [10.0, 10.0]]
    # After round 2 facility 0 has 4 steps left, 1.5 + 3 x 0.5 = 3 s into round 3: it stops there (train.steps),
    # and facility 1 ends by then (its step, 2 s, then another would end past 3 s) instead of training on to 10 s.
    assert taken[2] == [4, 1] and ends[2] == [3.0, 2.0] and paces[0].taken == 40
    # The list form is not affected.
    listed = pace.RoundPace(FederationConfig(every=[4, 2]), SimpleNamespace(facility=0, facility_size=1), 8)
    assert listed.seconds_to_cap(4) == float("inf")


# ----------------------------------------------------------------------------- multi-process
LAYOUTS = [
    # 2 facilities x FSDP over 2 ranks: outer optimizers, plain mean, compression, synchronous.
    dict(
        name="fsdp_2x2",
        federated=2,
        hsdp=None,
        checks=["outer", "plain", "compression", "synchronous", "streaming", "divergence"],
    ),
    # 2 facilities x 2 replicas (HSDP): the replicas' hand-over, alternating-exp-ring, streaming's own groups.
    dict(
        name="hsdp_2x2",
        federated=2,
        hsdp=1,
        checks=["outer", "gossip", "compression", "synchronous", "streaming", "divergence"],
    ),
    # 4 facilities of one rank: gossip over ring / one-peer-exp / complete, compression among 4.
    dict(name="four_facilities", federated=1, hsdp=None, checks=["plain", "gossip", "compression"]),
]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_federation_on_4_processes():
    reports = launch_local(workers.run_layouts, (LAYOUTS,), 4)
    by = {name: [r[name] for r in reports] for name in (lay["name"] for lay in LAYOUTS)}
    assert all(r["outer_cases"] == 4 * 2 * 2 and r["sync_cases"] == 2 for r in by["fsdp_2x2"] + by["hsdp_2x2"])
    assert all(r["plain_cases"] == 3 for r in by["fsdp_2x2"] + by["four_facilities"])
    assert all(r["gossip_cases"] == 2 * 2 for r in by["hsdp_2x2"])  # ring, alternating-exp-ring; two outer rules
    assert all(r["gossip_cases"] == 3 * 2 for r in by["four_facilities"])
    assert all(r["compression_cases"] == 4 for rs in by.values() for r in rs)
    assert all(r["streaming_cases"] == 1 for r in by["fsdp_2x2"] + by["hsdp_2x2"])
    assert all(r["divergence_cases"] == 3 for r in by["fsdp_2x2"] + by["hsdp_2x2"])
    # Bytes counted from the messages: 2 facilities, the wide model, every rank sends.
    for r in by["fsdp_2x2"]:
        sent = r["compressed_bytes"]
        assert sent["none"] > 0 and sent["uint8"] <= 0.27 * sent["none"] and sent["bf16"] <= 0.51 * sent["none"], sent
    # HSDP: only the first replica of each facility crosses the boundary.
    assert sorted(r["compressed_bytes"]["uint8"] > 0 for r in by["hsdp_2x2"]) == [False, False, True, True]


@pytest.mark.cli
@pytest.mark.slow
def test_job_with_diloco_and_uint8(tmp_path):
    """The main job wires the federation in: DiLoCo rounds over a compressed exchange with error
    feedback and token weights leave every copy identical, and about a quarter of fp32's bytes cross."""
    import json

    import yaml
    from helpers import TINY, run_cli

    from xffl_like.models import LlamaConfig, build_model

    args = [
        "+experiment=llama_fed",
        "distributed.nproc_per_node=2",
        "distributed.federated=1",
        "train.steps=4",
        "optim.warmup_steps=2",
        "federation.every=2",
        "federation=diloco",
        "federation.compression=uint8",
        "federation.error_feedback=true",
        "federation.weights=tokens",
        "logger=none",
        *TINY,
    ]
    proc, _ = run_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["federation"] == {
        "algorithm": "federated",
        "every": 2,
        "topology": "complete",
        "outer": "nesterov",
        "outer_lr": 0.7,
        "compression": "uint8",
    }
    assert summary["layout"]["facility_sizes"] == [1, 1] and summary["rounds"] == 2
    assert summary["max_param_divergence_after_last_round"] == 0.0
    model = build_model(
        LlamaConfig.from_mapping(yaml.safe_load((tmp_path / "config.yaml").read_text())["model"]), device="meta"
    )
    fp32 = 2 * 4 * sum(p.numel() for p in model.parameters())  # both facilities send one fp32 copy
    sent = summary["cross_facility_bytes_per_round"]
    assert all(0.24 * fp32 <= b <= 0.27 * fp32 for b in sent), (sent, fp32)


# ----------------------------------------------------------------------------- streaming and phases: pure
def test_fragment_schedule_by_hand():
    from xffl_like.federation import fragment_of, sync_offsets, synced_at

    # H=10, K=3: offsets (k+1)*10//3 = 3, 6, 10 (the last where a whole-model round would be).
    assert sync_offsets(10, 3) == [3, 6, 10]
    table = {s: synced_at(s, 10, 3) for s in range(1, 27)}
    assert {s: f for s, f in table.items() if f} == {
        3: [0],
        6: [1],
        10: [2],
        13: [0],
        16: [1],
        20: [2],
        23: [0],
        26: [1],
    }
    assert {s for s in range(1, 41) if synced_at(s, 8, 1)} == {8, 16, 24, 32, 40}  # K=1: today's rounds
    assert sync_offsets(16, 4) == [4, 8, 12, 16] and synced_at(4, 4, 4) == [3] and synced_at(1, 4, 4) == [0]
    names = [
        "tok_embeddings.weight",
        *[f"layers.{b}.{w}" for b in range(4) for w in ("attention.wq.weight", "ffn_norm.weight")],
        "norm.weight",
        "output.weight",
    ]
    # Blocks 0..3 of 4 in 3 fragments: b*3//4 = 0, 0, 1, 2; embeddings first, norm and head last.
    assert fragment_of(names, 4, 3) == [0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2]
    assert fragment_of(names, 4, 2) == [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert fragment_of(names, 4, 1) == [0] * 11


def test_phases_merge_over_the_top_level_keys():
    from xffl_like.federation import plan_phases

    top = workers.plain_spec(every=10, outer=dict(name="nesterov", lr=0.7, momentum=0.9))
    typed = build_section(FederationConfig, top)
    scheduled = build_section(
        FederationConfig,
        {
            **top,
            "schedule": [{"until_step": 5, "every": 2, "outer": {"lr": 0.5}}, {"until_step": None, "fragments": 2}],
        },
    )
    phases = plan_phases(scheduled, steps=20)
    assert [(p.from_step, p.until_step) for p in phases] == [(0, 5), (5, None)]
    assert phases[0].spec["every"] == 2 and phases[0].spec["outer"] == {**top["outer"], "lr": 0.5}
    assert (
        phases[1].spec["every"] == 10 and phases[1].spec["fragments"] == 2 and phases[1].spec["outer"] == top["outer"]
    )
    assert "schedule" not in phases[0].spec and phases[0].config.every == 2 and phases[0].config.outer.lr == 0.5
    assert [p.config for p in plan_phases(typed)] == [typed]
    assert [p.spec for p in plan_phases(typed)] == [{k: v for k, v in as_plain(typed).items() if k != "schedule"}]


SCHEDULE_BAD = [
    (dict(fragments=0), "federation.fragments=0: must be a positive integer"),
    (dict(every=4, fragments=5), "federation.fragments=5 exceeds federation.every=4"),
    (
        dict(every=10, fragments=2, overlap_steps=5),
        "federation.overlap_steps=5 must be < federation.every/fragments = 10/2",
    ),
    (dict(overlap_steps=-1), "federation.overlap_steps=-1: must be an integer >= 0"),
    (dict(merge_alpha=1.5), "federation.merge_alpha=1.5: must be a number in [0, 1]"),
    (dict(every=4, fragments=2, topology="ring"), "streaming gossip is not supported"),
    (dict(algorithm="synchronous", every=4, fragments=2), "so federation.fragments does not apply"),
    (dict(schedule={"until_step": 5}), "federation.schedule={'until_step': 5}: must be a non-empty list"),
    (dict(schedule=[{"every": 2}]), "federation.schedule[0]: until_step is missing"),
    (
        dict(schedule=[{"until_step": 5}, {"until_step": 5}]),
        "federation.schedule[1].until_step=5: must be an integer > 5",
    ),
    (
        dict(schedule=[{"until_step": None}, {"until_step": None}]),
        "federation.schedule[0].until_step=null: only the last",
    ),
    (dict(schedule=[{"until_step": 5}, {"until_step": 8}]), "the last phase ends before train.steps=20"),
    (
        dict(schedule=[{"until_step": None, "on_nonfinite": "skip"}]),
        "federation.schedule[0]: unknown key(s) ['on_nonfinite']",
    ),
    (
        dict(
            schedule=[
                {"until_step": 4, "algorithm": "synchronous"},
                {"until_step": None, "outer": {"name": "nesterov"}},
            ]
        ),
        "federation.schedule[1]: federation.outer.name=nesterov needs federation.outer.momentum > 0",
    ),
    (
        dict(schedule=[{"until_step": None, "every": 10, "fragments": 9}]),
        "federation.schedule[0]: federation.fragments=9 exceeds the model's 4 blocks",
    ),
]


@pytest.mark.parametrize("override, message", SCHEDULE_BAD, ids=[m.split(":")[0][:40] for _, m in SCHEDULE_BAD])
def test_bad_streaming_and_schedule_options(override, message):
    with pytest.raises(ValueError) as err:
        check_fragments(validate_federation(workers.spec(**override), plan_layout(4, 2, None), steps=20), num_layers=4)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


# ----------------------------------------------------------------------------- streaming and phases: a job
@pytest.mark.cli
@pytest.mark.slow
def test_job_with_phases_fragments_and_overlap(tmp_path):
    """One job, three phases: synchronous until step 3; fragments=2 (DiLoCo, weights [1, 3]) until
    step 9; fragments=2 with overlap_steps=1 to the end. Every round's values are replayed here
    in float64 from the recorded shards (helpers/round_values.py: check_streaming_values)."""
    from helpers import TINY, run_recorded
    from helpers.round_values import check_streaming_values

    nesterov = "outer:{name:nesterov,lr:0.7,momentum:0.9}"
    schedule = (
        f"[{{until_step:3,algorithm:synchronous}},{{until_step:9,every:4,fragments:2,weights:[1,3],{nesterov}}},"
        f"{{until_step:null,every:4,fragments:2,overlap_steps:1,merge_alpha:0.25,{nesterov}}}]"
    )
    args = [
        "+experiment=llama_fed",
        "distributed.nproc_per_node=2",
        "distributed.federated=1",
        "train.steps=15",
        f"federation.schedule={schedule}",
        "logger=none",
        "checkpoint.every_rounds=100",
        *TINY,
    ]
    _, summary = run_recorded(args, tmp_path)
    # Which fragment at which step, by hand: phase 1 from step 3 with offsets 2 and 4; phase 2 from
    # step 9, fragment 0 started at 10 and applied at 11, fragment 1 started at 12 and applied at 13,
    # both again (without overlap) at the last step.
    got = [(r["step"], r["phase"], r["fragment"], r["switch"], r["started_step"]) for r in summary["round_records"]]
    assert got == [
        (3, 0, None, True, 3),
        (5, 1, 0, False, 5),
        (7, 1, 1, False, 7),
        (9, 1, None, True, 9),
        (11, 2, 0, False, 10),
        (13, 2, 1, False, 12),
        (15, 2, 0, False, 15),
        (15, 2, 1, False, 15),
    ]
    assert [(p["from_step"], p["until_step"], p["config"]["fragments"]) for p in summary["federation"]["phases"]] == [
        (0, 3, 1),
        (3, 9, 2),
        (9, 15, 2),
    ]
    phases = [
        dict(weights=None, fragments=1, overlap_steps=0, merge_alpha=0.5, lr=1.0, momentum=0.0),
        dict(weights=[1.0, 3.0], fragments=2, overlap_steps=0, merge_alpha=0.5, lr=0.7, momentum=0.9),
        dict(weights=None, fragments=2, overlap_steps=1, merge_alpha=0.25, lr=0.7, momentum=0.9),
    ]
    figures = check_streaming_values(tmp_path / "rounds", summary, phases, num_layers=4)
    assert figures["spread"] > 1e-4 and figures["largest_change"] > 1e-4, figures
    # Bytes per fragment: each facility's fp32 fragment once (a ring all-reduce between two facilities).
    from helpers.round_values import hand_fragments, load_rounds

    shapes = load_rounds(tmp_path / "rounds")[(0, "init")][0]["shapes"]
    owner = hand_fragments(list(shapes), 4, 2)
    fragment_bytes = [sum(4 * torch.Size(s).numel() for n, s in shapes.items() if owner[n] == k) for k in (0, 1)]
    model_bytes = sum(fragment_bytes)
    want = [2 * (model_bytes if r["switch"] else fragment_bytes[r["fragment"]]) for r in summary["round_records"]]
    assert summary["cross_facility_bytes_per_round"] == want
    assert summary["max_param_divergence_after_last_round"] == 0.0
