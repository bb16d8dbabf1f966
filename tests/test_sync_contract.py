"""The :class:`~xffl_like.train.sync.Sync` contract: each implementation driven through the real
:class:`~xffl_like.train.trainer.Trainer` loop in a one-process gloo world (``gloo_world``).

:class:`~xffl_like.train.sync.FederatedSync` and :class:`~xffl_like.train.elastic.ElasticSync` run
on the real sharded model and checkpointer with a recording fake of their federation (torchft's
``create_autospec(Manager)`` pattern: the federation's signatures, canned answers, every call kept
in order) and a real round clock (each step's :class:`~xffl_like.federation.protocol.Boundary` is its
answer); :class:`~xffl_like.train.dataparallel.DataParallelSync` runs whole (Bagua's gradient
all-reduce over one rank), its own methods wrapped to record their calls.
What the calls should be is computed here from the job's numbers, never from the code under test.
"""

from __future__ import annotations

import functools
import json
import signal
import time
from dataclasses import replace
from pathlib import Path
from unittest.mock import Mock, call, create_autospec

import pytest
import torch
from helpers import REPO, TINY

from xffl_like.checkpoint import Checkpointer
from xffl_like.checkpoint.store import checkpoint_name
from xffl_like.config.schema import as_plain, job_config
from xffl_like.config.validate import validate_config
from xffl_like.distributed import signals
from xffl_like.federation import FederationSchedule
from xffl_like.federation.clock import end_clock, round_clock
from xffl_like.federation.elastic.exchange import ElasticFederation
from xffl_like.federation.protocol import Boundary
from xffl_like.federation.record import RoundRecord
from xffl_like.job import _compose, choices, resolve
from xffl_like.observe import observer
from xffl_like.observe.timing import PhaseTimer
from xffl_like.train import trainer as trainer_module
from xffl_like.train.dataparallel import DataParallelSync, build_full_model
from xffl_like.train.elastic import ElasticSync
from xffl_like.train.sync import Capabilities, FederatedSync, ShardedParts, TrainerHooks
from xffl_like.train.trainer import Parts, Trainer

STEPS, EVERY, ACCUM = 6, 2, 2
BATCH, SEQ = 4, 64  # TINY's train.batch_size, train.seq_len (and train.log_every=5)
LOG_EVERY = 5
TOKENS = BATCH * SEQ * ACCUM  # what one step trains on, on the one rank
BOUNDARIES = range(EVERY, STEPS + 1, EVERY)  # 2, 4, 6: rounds, checkpoints
STARTS = (0, 2, 4)  # where the clock starts exchanges that overlap the next steps
SMALL = ["model.dim=64", "model.n_layers=2", "model.ffn_dim=128"]  # the contract is the same on any model
JOB = ["distributed.nproc_per_node=1", f"train.steps={STEPS}", "logger=none", "checkpoint.async=false", *TINY, *SMALL]
FEDERATED = [
    "+experiment=llama_fed",
    "distributed.federated=1",
    f"federation.every={EVERY}",
    f"train.grad_accum={ACCUM}",
]
ELASTIC = [*FEDERATED, "federation.elastic.hub=localhost:29999", "federation.elastic.facility=a"]
BAGUA = ["+experiment=bagua_switch", "parallel.switch=[]"]  # gradient all-reduce throughout


# ----------------------------------------------------------------------------- helpers
@functools.cache
def job(*overrides: str):
    """The job of ``overrides`` composed as the launcher does, validated for one process: what a worker
    gets (immutable: composed once per module)."""
    composed = _compose([*overrides, *JOB])
    cfg, _ = validate_config(job_config(resolve(composed), choices(composed)), 1, 1, REPO)
    return cfg


def round_record(index: int, done: int) -> dict:
    """The record the fake federation returns for round ``index`` after ``done`` steps."""
    return {
        "round": index,
        "step": done,
        "fragment": None,
        "seconds": 0.0,
        "bytes_per_rank": 1000 * (index + 1),
        "cross_facility_bytes": 10 * (index + 1),
        "skipped_facilities": [],
    }


def boundary(done: int, rounds=BOUNDARIES, starts=(), end=STEPS) -> Boundary:
    """What the clock says step ``done`` is, from the job's numbers: rounds (and checkpoints) at ``rounds``,
    exchanges that start after the steps in ``starts``, the end after ``end`` steps."""
    due = done in rounds
    return Boundary(
        done, eval_due=due or done == end, finish=(0,) if due else (), start=(0,) if done in starts else (),
        end=done == end, job_step=done, checkpoint=due or done == end,
    )  # fmt: skip


def start_boundary(done: int, starts=()) -> Boundary:
    """What the clock says starts before the first step, after ``done`` steps."""
    return Boundary(done, start=(0,) if done in starts else (), job_step=done)


class StartsAt:
    """The real ``clock``, whose boundaries say that exchanges start after the steps in ``starts``."""

    def __init__(self, clock, starts):
        self.clock, self.starts = clock, starts

    def __getattr__(self, name):
        return getattr(self.clock, name)

    def _with(self, b: Boundary) -> Boundary:
        return replace(b, start=(0,) if b.step in self.starts else ())

    def start(self, done):
        return self._with(self.clock.start(done))

    def at(self, done):
        return self._with(self.clock.at(done))

    def plan(self, done):
        return self._with(self.clock.plan(done))


def fake_federation(kind, clock):
    """A recording fake of ``kind`` (its signatures): a round's record wherever the real ``clock`` says."""
    fake = create_autospec(kind, instance=True)
    fake.clock = clock
    fake.finish.side_effect = lambda b, index: [RoundRecord.from_dict(round_record(index, b.step))] if b.finish else []
    fake.state_dict.side_effect = lambda: {"rounds": torch.tensor(0), "tokens": torch.zeros(1, dtype=torch.float64)}
    fake.describe.side_effect = lambda: {"algorithm": "fake", "elastic": {"facility": "a"}}
    if hasattr(kind, "message_stats"):  # a schedule's close() asks it; an elastic federation has none
        fake.message_stats.side_effect = lambda: {}
    return fake


def checkpointer(cfg, state, run_dir: Path, parts: ShardedParts, sync, log: Mock) -> Checkpointer:
    """The job's real checkpointer, its cadence's saves recorded as ``log.checkpoint(step)``."""
    ckpt = Checkpointer(
        cfg.checkpoint, state, run_dir, parts.model, parts.optimizer, parts.scheduler, sync, config=as_plain(cfg)
    )
    real = ckpt.after_round

    def after_round(step, *args, **kwargs):
        log.checkpoint(step)
        return real(step, *args, **kwargs)

    ckpt.after_round = after_round
    return ckpt


def trainer(cfg, state, run_dir: Path, model, sync, clock, ckpt, identity=None) -> Trainer:
    identity = identity or (cfg.seed, state.facility, state.num_facilities)
    parts = Parts(model, sync, clock, ckpt, identity)
    setup_rss = torch.tensor(0.0, dtype=torch.float64)
    return Trainer(cfg, state, run_dir, parts, sync.timer, setup_rss, time.time(), as_plain(cfg))


def federated(cfg, state, run_dir: Path):
    """A FederatedSync over a recording fake schedule; (trainer, fake, log): ``log`` holds the fake's
    calls and the checkpoints in one order."""
    parts = ShardedParts.build(cfg, state, cfg.train.steps)
    clock = StartsAt(round_clock(cfg.federation, state, cfg.train.steps, end=cfg.train.steps), STARTS)
    rounds = fake_federation(FederationSchedule, clock)
    described = {"name": cfg.strategy.name, "streams": cfg.strategy.streams}
    sync = FederatedSync(
        state, parts, rounds, clock, TrainerHooks(None, []), PhaseTimer(state.device), paced=False,
        strategy=described,
    )  # fmt: skip
    log = Mock()
    log.attach_mock(rounds, "rounds")
    ckpt = checkpointer(cfg, state, run_dir, parts, sync, log)
    return trainer(cfg, state, run_dir, parts.model, sync, sync.clock, ckpt), rounds, log


def expected_federated_calls(stop_at: int | None = None) -> list:
    """The fake's calls and the checkpoints, in order, of a job of STEPS steps with rounds every EVERY
    (stopped after ``stop_at`` steps): the start's exchanges; per step ``trained``, ``after_backward``;
    at a boundary the round, then its checkpoint (which reads the federation's state), then, unless the
    job stops there, the exchanges that start there."""
    calls = [call.rounds.start(start_boundary(0, STARTS), 0)]
    index = 0
    for done in range(1, STEPS + 1):
        calls += [call.rounds.trained(TOKENS), call.rounds.after_backward()]
        if done in BOUNDARIES:
            b = boundary(done, starts=STARTS)
            calls += [call.rounds.finish(b, index), call.checkpoint(done), call.rounds.state_dict()]
            index += 1
        if done == stop_at:
            return calls
        if done in STARTS:
            calls.append(call.rounds.start(boundary(done, starts=STARTS), index))
    return [*calls, call.rounds.describe(), call.rounds.message_stats()]  # close(): the summary's federation


def elastic(cfg, state, run_dir: Path, join_at: int):
    """An ElasticSync over a recording fake federation that a join answers with ``join_at``; (trainer, fake)."""
    parts = ShardedParts.build(cfg, state, cfg.train.steps)
    clock = round_clock(cfg.federation, state, cfg.train.steps, elastic=True)
    federation = fake_federation(ElasticFederation, clock)
    federation.name, federation.options = cfg.federation.elastic.facility, cfg.federation
    federation.join.return_value = join_at
    described = {"name": cfg.strategy.name, "streams": cfg.strategy.streams}
    sync = ElasticSync(parts, federation, PhaseTimer(state.device), rewarm=cfg.optim.warmup_steps, strategy=described)
    ckpt = checkpointer(cfg, state, run_dir, parts, sync, Mock())
    return trainer(cfg, state, run_dir, parts.model, sync, sync.clock, ckpt, identity=(cfg.seed, 0, 1)), federation


def record_batches(t: Trainer) -> list[int]:
    """The indices of the micro-batches the trainer draws from its data source, as it draws them."""
    drawn, real = [], t.data.train_batch

    def train_batch(index):
        drawn.append(index)
        return real(index)

    t.data.train_batch = train_batch
    return drawn


def stop_before(t: Trainer, step: int, signum=signal.SIGTERM) -> None:
    """A stop request (as the signal handler records it) arrives just before 0-based step ``step``."""
    real = t.train_step

    def train_step(s):
        if s == step:
            signals._request["signum"] = signum
        real(s)

    t.train_step = train_step


@pytest.fixture(autouse=True)
def no_plots(monkeypatch):
    """The summary's plots are not the contract's (and matplotlib takes a second per job here)."""
    monkeypatch.setattr(observer, "plot_losses", lambda *args: None)
    monkeypatch.setattr(observer, "plot_aggregation", lambda *args: None)


@pytest.fixture
def stop_request():
    """The stop request's state as it was before the test, restored after it."""
    saved = dict(signals._request)
    yield
    signals._request.clear()
    signals._request.update(saved)


def checkpoints(run_dir: Path) -> list[str]:
    """The complete checkpoints kept in the run (``checkpoint.keep=2``)."""
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.is_dir() and not p.name.startswith("."))


def logged_steps(run_dir: Path, key: str = "loss") -> list[int]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [line["step"] for line in lines if key in line]


# ----------------------------------------------------------------------------- FederatedSync
def test_federated_sync_rounds_checkpoints_and_exchanges_in_order(gloo_world, tmp_path):
    cfg, run_dir = job(*FEDERATED), tmp_path / "run"
    t, rounds, log = federated(cfg, gloo_world, run_dir)
    assert t.sync.capabilities == Capabilities(checkpoints=True)

    summary = t.train()

    assert log.mock_calls == expected_federated_calls()
    # Spelled out: every step trains TOKENS; rounds at the boundaries, numbered by the rounds before them.
    assert rounds.trained.call_args_list == [call(TOKENS)] * STEPS
    assert rounds.finish.call_args_list == [call(boundary(done, starts=STARTS), i) for i, done in enumerate(BOUNDARIES)]
    for done in (2, 4):  # a boundary's checkpoint holds its round, and nothing that starts after it
        at = log.mock_calls.index(call.checkpoint(done))
        assert log.mock_calls[at - 1] == call.rounds.finish(boundary(done, starts=STARTS), done // EVERY - 1)
        assert call.rounds.start(boundary(done, starts=STARTS), done // EVERY) in log.mock_calls[at:]
    # The summary's rounds are what the federation returned; training ended at train.steps.
    made = [round_record(i, done) for i, done in enumerate(BOUNDARIES)]
    assert [{k: r.get(k) for k in made[0]} for r in t.rounds] == made
    assert summary["rounds"] == len(made) and summary["steps"] == STEPS
    assert summary["aggregation_bytes_per_rank"] == [r["bytes_per_rank"] for r in made]
    assert [r["step"] for r in summary["round_records"]] == list(BOUNDARIES)
    assert summary["federation"] == {"algorithm": "fake", "elastic": {"facility": "a"}}
    assert summary["checkpoints"]["saves"] == len(made)
    assert summary["checkpoints"]["latest"] == str(run_dir / "checkpoints" / checkpoint_name(STEPS))
    assert logged_steps(run_dir) == list(range(1, STEPS + 1))


# A grace no step time can exceed, and none: the rule decides, not how fast this machine is today.
@pytest.mark.parametrize("grace", [1e9, 0.0], ids=["next-boundary", "at-once"])
def test_federated_sync_stops_at_the_next_boundary_within_the_grace(
    gloo_world, tmp_path, stop_request, monkeypatch, grace
):
    monkeypatch.setattr(trainer_module, "STOP_GRACE_S", grace)
    cfg, run_dir = job(*FEDERATED), tmp_path / "run"
    t, rounds, log = federated(cfg, gloo_world, run_dir)
    stop_before(t, 2)  # seen after 3 steps; the next boundary, 4, is a step away

    stopped = t.train()["interrupted"]

    at = 4 if grace else 3  # with no grace at all: at once, between boundaries, no checkpoint of its own
    assert log.mock_calls == expected_federated_calls(stop_at=at)
    assert stopped["signal"] == "SIGTERM" and stopped["step"] == at and stopped["steps"] == STEPS
    last = str(run_dir / "checkpoints" / checkpoint_name(EVERY * (at // EVERY)))
    assert stopped["checkpoint"] == (last if grace else None) and stopped["last_checkpoint"] == last
    assert stopped["left"] is None
    assert rounds.trained.call_count == at
    assert checkpoints(run_dir) == [checkpoint_name(s) for s in BOUNDARIES if s <= at]


# ----------------------------------------------------------------------------- ElasticSync
@pytest.mark.filterwarnings("error:Detected call of `lr_scheduler")  # a joiner moves its schedule quietly
def test_elastic_sync_late_joiner_adopts_the_federation_step_and_leaves_when_closed(gloo_world, tmp_path):
    cfg, run_dir = job(*ELASTIC), tmp_path / "run"
    t, federation = elastic(cfg, gloo_world, run_dir, join_at=4)
    drawn = record_batches(t)
    assert t.sync.capabilities == Capabilities(checkpoints=True, elastic=True)

    summary = t.train()

    federation.join.assert_called_once_with(0)  # before the first step, after none restored
    assert t.first_step == 4 and t.data_shift == -4
    assert logged_steps(run_dir) == [5, 6]  # training starts at the federation's step
    assert drawn == list(range((STEPS - 4) * ACCUM))  # the data keep their own position: from batch 0
    assert federation.trained.call_args_list == [call(TOKENS)] * (STEPS - 4)
    assert federation.finish.call_args_list == [call(boundary(6), 0)]
    assert [name for name, *_ in federation.mock_calls[-2:]] == ["leave", "describe"]  # close() leaves
    federation.leave.assert_called_once_with()
    assert summary["rounds"] == 1 and summary["steps"] == STEPS
    assert summary["federation"]["elastic"]["rewarm"] == {"from_step": 4, "steps": cfg.optim.warmup_steps}
    # Steps before the join were not taken: no loss (not 0.0); the first loss is the join's first step's.
    assert summary["facility_losses"][0][:4] == [None] * 4 and all(summary["facility_losses"][0][4:])
    assert summary["first_loss"] == summary["facility_losses"][0][4]
    assert checkpoints(run_dir) == [checkpoint_name(STEPS)]


def test_elastic_facility_that_ends_early_reports_the_steps_it_took(gloo_world, tmp_path):
    """The federation ended after the facility's 4th step (another reached train.steps, or every_s's last round):
    the summary says 4 steps, the 4th step's loss as the final one, and no loss for steps 5 and 6."""
    cfg, run_dir = job(*ELASTIC), tmp_path / "run"
    t, federation = elastic(cfg, gloo_world, run_dir, join_at=0)
    real = t.clock.at
    t.clock.at = lambda done: replace(real(done), end=done == 4)  # as an ended federation's round says so

    summary = t.train()

    losses = summary["facility_losses"][0]
    assert summary["steps"] == 4 and len(losses) == 4 and None not in losses, summary
    assert summary["final_loss"] == losses[3] and summary["first_loss"] == losses[0]
    assert summary["final_loss"] > 1.0 and summary["rounds"] == 2


def test_elastic_facility_realigned_mid_run_keeps_its_data_position_and_resumes_exactly(gloo_world, tmp_path):
    """Issue 37: a round realigns the facility's step to the federation's, on (2 -> 4: it was behind) and back
    (6 -> 2: it had trained through rounds): training goes on from there, the data keep their position, the clock,
    the log rows, the checkpoints' steps and the end follow the step; a resume from a checkpoint taken after a
    realign draws the same batches as the run did from there."""
    cfg, run_dir = job(*ELASTIC), tmp_path / "run"
    t, federation = elastic(cfg, gloo_world, run_dir, join_at=0)
    steps = iter([4, 2, 4, 6])  # what each round's record says the federation's step is
    federation.finish.side_effect = lambda b, index: [RoundRecord.from_dict(round_record(index, next(steps)))]
    drawn = record_batches(t)

    summary = t.train()

    assert drawn == list(range(8 * ACCUM))  # 8 steps trained, the data from their own position throughout
    assert logged_steps(run_dir) == [1, 2, 5, 6, 3, 4, 5, 6]
    assert federation.finish.call_args_list == [call(boundary(2), 0), call(boundary(6), 1), call(boundary(4), 2),
                                                call(boundary(6), 3)]  # fmt: skip
    assert summary["rounds"] == 4 and t.sync.parts.scheduler.last_epoch == STEPS  # the schedule followed the step
    assert checkpoints(run_dir) == [checkpoint_name(4), checkpoint_name(6)]  # step 4 saved again after the realign
    state = json.loads((run_dir / "checkpoints" / checkpoint_name(4) / "state.json").read_text())
    assert state["step"] == 4 and state["records"]["data_shift"] == 2  # step 4 trains on batch 6 (of 0, 1, ...)

    again, federation = elastic(cfg, gloo_world, tmp_path / "again", join_at=4)
    again.checkpointer.resume = str(run_dir / "checkpoints" / checkpoint_name(4))
    resumed = record_batches(again)
    again.train()
    assert resumed == list(range(6 * ACCUM, 8 * ACCUM))  # steps 4 and 5 on the batches the run drew for them


def test_elastic_sync_stops_at_once_and_leaves(gloo_world, tmp_path, stop_request):
    cfg, run_dir = job(*ELASTIC), tmp_path / "run"
    t, federation = elastic(cfg, gloo_world, run_dir, join_at=0)
    stop_before(t, 2)  # seen after 3 steps, between boundaries

    stopped = t.train()["interrupted"]

    assert stopped["step"] == 3 and stopped["signal"] == "SIGTERM"
    here = str(run_dir / "checkpoints" / checkpoint_name(3))  # an elastic facility saves at any step
    assert stopped["checkpoint"] == here and stopped["last_checkpoint"] == here
    assert stopped["left"] == "facility a left the federation at the hub localhost:29999"
    federation.leave.assert_called_once_with()
    assert federation.trained.call_count == 3
    assert federation.finish.call_args_list == [call(boundary(2), 0)]
    assert checkpoints(run_dir) == [checkpoint_name(2), checkpoint_name(3)]


# ----------------------------------------------------------------------------- DataParallelSync
def test_data_parallel_sync_logs_consensus_and_averages_after_the_last_step(gloo_world, tmp_path):
    cfg, run_dir = job(*BAGUA), tmp_path / "run"
    state = gloo_world
    model = build_full_model(cfg, state)
    sync = DataParallelSync(cfg, state, model, PhaseTimer(state.device))
    assert sync.capabilities == Capabilities()
    log = Mock()
    for name in ("metrics", "start", "average", "close"):  # the instance's own, recorded in one order
        wrapped = Mock(wraps=getattr(sync, name))
        setattr(sync, name, wrapped)
        log.attach_mock(wrapped, name)
    t = trainer(cfg, state, run_dir, model, sync, end_clock(cfg.train.steps), None)

    summary = t.train()

    expected = [call.start(start_boundary(0), 0)]  # before the first step: nothing to switch yet
    for done in range(1, STEPS + 1):
        expected += [call.metrics(done), call.start(boundary(done, rounds=()), 0)]
    expected += [call.average(), call.close()]  # the final mean right after the last step, then the summary
    assert log.mock_calls == expected
    log_steps = [s for s in range(1, STEPS + 1) if s % LOG_EVERY == 0 or s == STEPS]
    assert [c["step"] for c in sync.consensus] == log_steps == logged_steps(run_dir, "consensus_distance")
    extra = sync.close()["extra"]
    assert {k: summary[k] for k in extra} == extra
    assert extra["parallel"]["name"] == "bagua" and extra["consensus_distance"] == sync.consensus
    assert summary["rounds"] == 0 and summary["checkpoints"] is None and summary["steps"] == STEPS
