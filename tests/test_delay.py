"""Issues 29 and 39 (item 2): the delayed, overlapped outer step (``federation.delay=1``, ``federation/delayed.py``).

Every boundary of three jobs is recomputed here by hand from the values the ranks recorded, with the rules as
docs/running.md states them. ``eager`` (the default): ``Δ_r = θ_f - x_r``; each facility steps its own ``θ_f``
and outer state on ``s_f Δ_r + D_{r-1} - s_f Δ_{r-1}``; at the end ``D_r`` replaces the fresh share and the job
ends on ``Σ_f s_f θ_f``: with top-k and error feedback and Nesterov over FSDP shards (the messages against the
reference encoder of ``helpers.sparseloco_reference``), and without compression, fixed weights, own paces and a
facility of two replicas. ``own_full``: the local model ``θ_g - Δ_r``, ``θ_g`` stepping on the landed means,
on that second job. The top-k job killed mid-round, while a delayed exchange is in flight, and restarted by
the elastic launcher ends bitwise equal to the uninterrupted one. Then the refusals.
"""

from __future__ import annotations

import re
import shutil

import pytest
import torch
from helpers import run_recorded
from helpers.round_values import MIN_FACILITY_SPREAD, load_rounds
from helpers.same_run import assert_same_run, run_job, summary
from helpers.sparseloco_reference import ref_decode, ref_encode, sender_mean, topk_overrides

from xffl_like.checkpoint.store import checkpoint_name
from xffl_like.config.schema import FederationConfig, build_section
from xffl_like.distributed.layout import plan_layout
from xffl_like.federation import validate_federation

JOB = [
    "+experiment=llama_fed",
    "train.steps=6",
    "federation.every=2",
    "train.seq_len=32",
    "train.batch_size=2",
    "train.log_every=4",
    "optim.warmup_steps=1",
    "train.eval_every=0",
    "logger=none",
    "federation.delay=1",
    "data.num_eval_batches=1",  # as helpers.TINY: no test here reads an evaluation
]
DENSITY, BITS, DECAY, TILE, LR, MOMENTUM = 0.0625, 4, 0.9, 16, 0.7, 0.9  # 16 of each 16 x 16 tile, 16 bins
TOPK = [
    *topk_overrides(DENSITY, BITS, DECAY, TILE),
    "federation.outer.name=nesterov",
    f"federation.outer.lr={LR}",
    f"federation.outer.momentum={MOMENTUM}",
]
BOUNDARIES = 3  # after steps 2, 4 and 6 (the last)


def _flat(record: dict) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in record["params"].values()])


def _by_place(records: list[dict]) -> dict[tuple[int, int, int], dict]:
    return {(r["facility"], r["replica"], r["shard"]): r for r in records}


def _nesterov(theta: torch.Tensor, buf: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.optim.SGD(nesterov=True)'s step on ``theta`` with gradient ``d``, in float64."""
    buf = MOMENTUM * buf + d
    return theta - LR * (d + MOMENTUM * buf), buf


@pytest.fixture(scope="module")
def topk_runs(tmp_path_factory):
    """The top-k job uninterrupted (its rounds recorded), and killed at step 5 and restarted: the step-4
    checkpoint holds round 2's step, whose exchange was running in the background when rank 1 died."""
    base = tmp_path_factory.mktemp("delay")
    _, ref = run_recorded([*JOB, *TOPK], base)
    killed = run_job(
        [*JOB, *TOPK, "fault.kill_rank=1", "fault.at_step=5", "distributed.max_restarts=1", "checkpoint.async=false"],
        base / "killed",
    )
    return base, ref, killed


@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_topk_nesterov_eager_rounds_by_hand(topk_runs):
    """2 facilities x FSDP over 2 ranks, eager. Per shard, from the recorded values: Δ_r = θ_f - x_r (θ_f: the
    parameters after the last boundary, or the start); the message sent after b_r is the reference encoding
    of decay * e + Δ_r (the tiles of this rank's shards), and e is that accumulator less what was sent; at b_r
    facility f's parameters are its own θ_f after a Nesterov step (its own momentum) on Δ_r / 2 + (D_{r-1} -
    Δ_{r-1} / 2), D per index the mean of the decoded messages over the facilities that sent it; at the end on
    D_r + (D_{r-1} - Δ_{r-1} / 2), and every copy is the mean of the θ_f."""
    base, s, _ = topk_runs
    assert s["federation"]["delay"] == 1 and s["federation"]["delay_rule"] == "eager"
    assert s["rounds"] == BOUNDARIES and [r["landed"] for r in s["round_records"]] == [[], [2], [4, 6]]
    rec = load_rounds(base / "rounds")
    init = _by_place(rec[(0, "init")])
    spread = apart = 0.0
    for shard in (0, 1):
        places = [(0, 0, shard), (1, 0, shard)]
        assert torch.equal(_flat(init[places[0]]), _flat(init[places[1]]))
        start = {f: _flat(init[p]) for f, p in enumerate(places)}
        shapes = [tuple(t.shape) for t in init[places[0]]["params"].values()]  # this rank's shards
        theta = {f: start[f].double() for f in (0, 1)}
        buf = {f: torch.zeros_like(theta[f]) for f in (0, 1)}
        residual = {f: torch.zeros_like(start[f]) for f in (0, 1)}
        landing, stale = None, None  # the decoded mean in flight, and each facility's Δ in it
        for b in range(BOUNDARIES):
            before, after = _by_place(rec[(b, "before")]), _by_place(rec[(b, "after")])
            last = b == BOUNDARIES - 1
            delta = {f: (start[f] - _flat(before[p])).double() for f, p in enumerate(places)}
            decoded, mask = {}, {}
            for f, p in enumerate(places):
                acc = residual[f] * DECAY + delta[f].float()
                sent = ref_encode(acc.numpy(), shapes, DENSITY, TILE, BITS)
                values, mask[f] = ref_decode(sent, shapes, DENSITY, TILE, BITS)
                decoded[f] = torch.from_numpy(values)
                if not last:  # recorded where its exchange starts, after the boundary's checkpoint
                    started = _by_place(rec[(b, "start")])[p]
                    assert started["message"].numpy().tobytes() == sent, f"boundary {b}, facility {f}"
                    assert torch.equal(started["residual"], acc - decoded[f])
                residual[f] = acc - decoded[f]
            spread = max(spread, float((decoded[0] - decoded[1]).abs().max()))
            mean = torch.from_numpy(sender_mean([decoded[0].numpy(), decoded[1].numpy()], [mask[0], mask[1]], [1, 1]))
            for f in (0, 1):
                fresh = mean if last else delta[f] / 2
                others = 0 if landing is None else landing - stale[f] / 2
                theta[f], buf[f] = _nesterov(theta[f], buf[f], fresh + others)
            landing, stale = mean, delta
            if not last:
                apart = max(apart, float((theta[0] - theta[1]).abs().max()))
            for f, p in enumerate(places):
                want = (theta[0] + theta[1]) / 2 if last else theta[f]
                err = float((_flat(after[p]).double() - want).abs().max())
                assert err <= 1e-6, f"boundary {b}, facility {f}, shard {shard}: {err:.3g} from the rule"
                start[f] = _flat(after[p])
        assert torch.equal(start[0], start[1])  # the end: one model
    assert spread > MIN_FACILITY_SPREAD  # the facilities sent different updates
    assert apart > MIN_FACILITY_SPREAD  # and held different models between rounds, as the rule implies
    assert s["cross_facility_bytes_per_round"][0] == 0 and all(b > 0 for b in s["cross_facility_bytes_per_round"][1:])


@pytest.mark.cli
@pytest.mark.slow
def test_killed_while_an_exchange_is_in_flight_restarts_bitwise_exact(topk_runs):
    base, _, killed = topk_runs
    assert killed.returncode == 0, killed.stderr
    s = summary(base / "killed")
    assert s["checkpoints"]["restarts"] == 1 and s["checkpoints"]["resumed_from"].endswith(checkpoint_name(4)), s
    assert_same_run(base / "killed", base / "run")


@pytest.mark.cli
@pytest.mark.slow
def test_resume_with_another_delay_is_refused(topk_runs, tmp_path):
    from hydra import compose, initialize_config_dir

    from xffl_like import CONF_DIR
    from xffl_like.job import JobFailed, run_local

    base, _, _ = topk_runs
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        args = [a for a in [*JOB, *TOPK] if not a.startswith("federation.delay")]
        cfg = compose(config_name="config", overrides=[*args, "federation.delay=0", "train.steps=8", f"resume={run}"])
    with pytest.raises(
        JobFailed, match=re.escape("the config differs from the checkpoint's in federation.delay (1 -> 0)")
    ):
        run_local(cfg, tmp_path / "fresh", worker=lambda *a: pytest.fail("a worker started"))


@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("rule", ["own_full", "eager"])
def test_plain_mean_with_replicas_by_hand(tmp_path, rule):
    """Facility 0 of 2 replicas taking 2 steps per round and facility 1 of one rank taking 1 (their own
    paces), no compression, weights [3, 1] (shares s = 3/4, 1/4), outer average at lr 0.8; the landed mean is
    D = (3 Δ_0 + Δ_1) / 4, and the replicas of facility 0 hold the same values throughout. own_full:
    Δ_r = s_r - x_r, θ_g -= 0.8 D_{r-1}, the parameters θ_g - Δ_r. eager: Δ_r = θ_f - x_r,
    θ_f -= 0.8 (s_f Δ_r + D_{r-1} - s_f Δ_{r-1}); at the end D_r in place of s_f Δ_r, then Σ_f s_f θ_f."""
    _, s = run_recorded(
        [
            *JOB,
            "distributed.nproc_per_node=3",
            "distributed.federated=[2,1]",
            "distributed.hsdp=1",
            "federation.every=[2,1]",
            "federation.weights=[3,1]",
            "federation.outer.name=average",
            "federation.outer.lr=0.8",
            f"federation.delay_rule={rule}",
        ],
        tmp_path,
    )
    assert s["rounds"] == BOUNDARIES and [r["steps_taken"] for r in s["round_records"]] == [[2, 1]] * BOUNDARIES
    assert s["federation"]["delay_rule"] == rule
    rec = load_rounds(tmp_path / "rounds")
    places, share = [(0, 0, 0), (1, 0, 0)], (0.75, 0.25)
    init = _by_place(rec[(0, "init")])
    start = {f: _flat(init[p]) for f, p in enumerate(places)}
    theta = {f: start[f].double() for f in (0, 1)}  # own_full: both the one θ_g
    landing, stale = None, None
    for b in range(BOUNDARIES):
        before, after = _by_place(rec[(b, "before")]), _by_place(rec[(b, "after")])
        assert torch.equal(_flat(after[(0, 0, 0)]), _flat(after[(0, 1, 0)]))  # the replicas agree
        last = b == BOUNDARIES - 1
        delta = {f: (start[f] - _flat(before[p])).double() for f, p in enumerate(places)}
        mean = share[0] * delta[0] + share[1] * delta[1]
        for f in (0, 1):
            if rule == "own_full":  # the stale mean, and at the end this round's
                theta[f] = theta[f] - 0.8 * (0 if landing is None else landing) - (0.8 * mean if last else 0)
            else:
                fresh = mean if last else share[f] * delta[f]
                theta[f] = theta[f] - 0.8 * (fresh + (0 if landing is None else landing - share[f] * stale[f]))
        landing, stale = mean, delta
        for f, p in enumerate(places):
            if rule == "own_full":
                want = theta[f] if last else theta[f] - delta[f]
            else:
                want = share[0] * theta[0] + share[1] * theta[1] if last else theta[f]
            err = float((_flat(after[p]).double() - want).abs().max())
            assert err <= 1e-6, f"{rule}, boundary {b}, facility {f}: {err:.3g} from the rule"
            start[f] = _flat(after[p])
    assert float((delta[0] - delta[1]).abs().max()) > MIN_FACILITY_SPREAD
    assert torch.equal(start[0], start[1])  # the end: one model


@pytest.mark.parametrize(
    "override, needle",
    [
        (dict(delay=2), "federation.delay=2: use 0"),
        (dict(delay=True), "federation.delay=True: use 0"),
        (dict(delay=1, algorithm="synchronous"), "so federation.delay does not apply"),
        (dict(delay=1, topology="ring"), "federation.delay=1 with federation.topology=ring"),
        (dict(delay=1, every=4, fragments=2), "federation.delay=1 with federation.fragments=2"),
        (dict(delay=1, schedule=[{"until_step": None, "every": 4}]), "federation.delay=1 with federation.schedule"),
        (dict(schedule=[{"until_step": None, "delay": 1}]), "federation.delay=1 with federation.schedule"),
        (dict(delay_rule="own_full"), "federation.delay_rule=own_full applies to federation.delay=1 (now 0)"),
        (dict(delay_rule="eager"), "federation.delay_rule=eager applies to federation.delay=1 (now 0)"),
        (dict(delay=1, delay_rule="late"), "federation.delay_rule='late': use eager"),
    ],
)
def test_bad_delay_options(override, needle):
    with pytest.raises(ValueError) as err:
        validate_federation(build_section(FederationConfig, override), plan_layout(4, 2, None), steps=8)
    assert needle in str(err.value) and "\n" not in str(err.value)
