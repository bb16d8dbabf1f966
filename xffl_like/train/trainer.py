"""The trainer: one skeleton for every job, its parts as typed attributes (as torchtitan's ``Trainer``).

:func:`build_trainer` builds the parts for the job's mode, the one place that chooses:

- ``model``: this rank's model (evaluated, measured, exported);
- ``sync``: what keeps its copies in step (:class:`~.sync.Sync`);
- ``clock``: what each step is (:class:`~xffl_like.federation.protocol.RoundClock`: rounds, a phase switch,
  exchanges that start, the end, a checkpoint's step);
- ``checkpointer``: the job's checkpoints (``None`` where the mode writes none);
- ``data``: this rank's batches.

:meth:`Trainer.train` restores, then loops over :meth:`~Trainer.train_step` and
:meth:`~Trainer.maybe_round`, and ends with :meth:`~Trainer.summarize` (rank 0: the summary, also
written to ``summary.json``; other ranks ``None``). After each step, one way: the clock says what the
step is (a :class:`~xffl_like.federation.protocol.Boundary`), the sync finishes what ends there,
:meth:`~Trainer.settle` evaluates, logs, checkpoints and runs :meth:`~Trainer.maybe_stop`, and the sync
starts what starts there unless training stops. It never asks what kind of sync it has: the sync
declares its :class:`~.sync.Capabilities`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..checkpoint.dcp import Checkpointer
from ..config.schema import JobConfig, as_plain
from ..data import build_data
from ..distributed.signals import agree_stop, signal_name
from ..distributed.state import DistributedState
from ..federation.clock import end_clock
from ..federation.protocol import Boundary, RoundClock
from ..federation.record import UNSET, RoundRecord
from ..observe import Observer
from ..observe.timing import PhaseTimer, gather_phase_table
from .evaluate import eval_points, evaluate, facility_eval
from .fault import FaultInjector
from .parallelize import forward_param_dtype, peak_rss_mb
from .speed import pin_determinism
from .step import accumulate_gradients
from .summary import gather_facility_losses, job_summary, max_param_divergence
from .sync import FederatedSync, ShardedParts, StepEnd, Sync, sharded_steps

__all__ = ["STOP_GRACE_S", "Parts", "Trainer", "build_parts", "build_trainer"]

#: After a stop request, training goes on to the next round boundary (where checkpoints are exact)
#: when that is at most this many seconds away; otherwise it stops at once, without a checkpoint.
STOP_GRACE_S = 5.0


@dataclass(frozen=True)
class Parts:
    """What :func:`build_parts` builds for the job's mode."""

    model: nn.Module
    sync: Sync
    clock: RoundClock
    checkpointer: Checkpointer | None
    data_identity: tuple[int, int, int]  # (seed, facility, facilities) of this rank's batches


def build_parts(
    cfg: JobConfig, state: DistributedState, run_dir: Path, timer: PhaseTimer, phases, config: dict
) -> Parts:
    """The model and what keeps its copies in step, for ``cfg.parallel.name`` and ``federation.elastic``
    (collective: every rank builds them at the same point). ``phases``: the launcher's plan of the federation;
    ``config``: the job as plain values (``schema.as_plain``), recorded in each checkpoint."""
    layout_identity = (cfg.seed, state.facility, state.num_facilities)
    if cfg.parallel.name != "fsdp":  # full copies: Decent-DP or Bagua
        from .dataparallel import DataParallelSync, build_full_model

        model = build_full_model(cfg, state)
        sync = DataParallelSync(cfg, state, model, timer)
        return Parts(model, sync, end_clock(cfg.train.steps), None, layout_identity)
    steps = sharded_steps(cfg, state)
    parts = ShardedParts.build(cfg, state, steps)
    if cfg.federation.elastic.enabled:  # this job is one facility of a federation of independent jobs
        from .elastic import ElasticSync, data_identity

        sync, identity = ElasticSync.build(cfg, state, parts, run_dir, steps, timer), data_identity(cfg)
    else:
        sync, identity = FederatedSync.build(cfg, state, parts, run_dir, timer, phases), layout_identity
    checkpointer = Checkpointer(
        cfg.checkpoint, state, run_dir, parts.model, parts.optimizer, parts.scheduler, sync,
        resume=cfg.resume, config=config,
    )  # fmt: skip
    return Parts(parts.model, sync, sync.clock, checkpointer, identity)


def build_trainer(cfg: JobConfig, state: DistributedState, run_dir: Path, started_at: float, phases) -> Trainer:
    """The job's trainer on this rank (collective)."""
    pin_determinism()  # XFFL_DETERMINISTIC=1: bench.gpu's bitwise checks
    torch.manual_seed(cfg.seed)
    timer = PhaseTimer(state.device)
    config = as_plain(cfg)  # recorded whole in each checkpoint's state.json and as W&B's run config
    parts = build_parts(cfg, state, run_dir, timer, phases, config)
    setup_rss = torch.tensor(peak_rss_mb(), dtype=torch.float64)
    dist.all_reduce(setup_rss, op=dist.ReduceOp.MAX)
    return Trainer(cfg, state, run_dir, parts, timer, setup_rss, started_at, config)


class StepLog:
    """Each step's facility loss stays on the device; the rows reach ``losses`` and the observer
    (metrics.jsonl, W&B, progress) in one host sync every ``train.log_every`` steps, and before
    anything that reads them (an evaluation, a round, a checkpoint, a stop, the end): a float() of
    the loss every step would make a GPU wait for each step's kernels before queueing the next."""

    def __init__(self, observer, losses: torch.Tensor, facility: int, tokens_per_step: int, timer):
        self.observer, self.losses, self.facility, self.tokens_per_step = observer, losses, facility, tokens_per_step
        self.timer = timer  # the rows' host sync and writes are the phase ``log``
        self.rows: list[tuple] = []

    def add(self, step: int, loss: torch.Tensor, lr: float, elapsed: float, evals: dict | None, extra: dict) -> None:
        self.rows.append((step, loss.detach(), lr, elapsed, evals, extra))

    def flush(self) -> None:
        if not self.rows:
            return
        with self.timer("log"):
            values = torch.stack([row[1].reshape(()) for row in self.rows]).tolist()  # the one host sync
            for (step, _, lr, elapsed, evals, extra), value in zip(self.rows, values):
                self.losses[self.facility, step] = value
                self.observer.step(step, value, lr, self.tokens_per_step, elapsed, evals, **extra)
        self.rows.clear()


class Trainer:
    """One rank's training job: its parts, the run's records, and the steps."""

    model: nn.Module
    sync: Sync
    clock: RoundClock
    checkpointer: Checkpointer | None
    timer: PhaseTimer
    observer: Observer
    losses: torch.Tensor  # row f: facility f's mean loss per step (filled by this rank's facility share), NaN: none
    rounds: list[RoundRecord]  # the round records
    evals: list[dict]  # {"step", "loss_local", "loss_global", "time"}: losses per facility, None when not evaluated

    def __init__(
        self, cfg, state, run_dir, parts: Parts, timer: PhaseTimer, setup_rss, started_at: float, config: dict
    ):
        tcfg = cfg.train
        self.cfg, self.tcfg, self.state, self.run_dir = cfg, tcfg, state, Path(run_dir)
        self.model, self.sync, self.clock, self.checkpointer = parts.model, parts.sync, parts.clock, parts.checkpointer
        self.timer, self.setup_rss, self.started_at, self.config = timer, setup_rss, started_at, config
        seed, facility, facilities = parts.data_identity
        self.data = build_data(
            cfg.data, vocab_size=cfg.model.vocab_size, seq_len=tcfg.seq_len, batch_size=tcfg.batch_size,
            seed=seed, facility=facility, num_facilities=facilities,
            facility_rank=state.facility_rank, facility_size=state.facility_size,
        )  # fmt: skip
        if state.device.type == "cuda":  # the next batch drawn on a thread, pinned, copied non_blocking
            from ..data.prefetch import Prefetcher

            self.data = Prefetcher(self.data)
        self.eval_batches = self.data.eval_batches()
        self.tokens_per_step = tcfg.batch_size * tcfg.seq_len * tcfg.grad_accum * state.world_size
        # NaN: no step taken (an elastic facility before it joined, any facility after its last step).
        self.losses = torch.full((state.num_facilities, tcfg.steps), float("nan"), dtype=torch.float64)
        self.fault = FaultInjector(cfg.fault, state.rank, state.facility)
        self.stop_at: int | None = None  # the step a stop request ends training at
        self.signum: int | None = None
        self.last = False  # training ends after the step just settled

    # ------------------------------------------------------------------ the whole job
    def train(self) -> dict | None:
        self.restore()
        dist.barrier()
        self.start, self.train_started_at = time.perf_counter(), time.time()
        try:
            done = self.begin()
            if self.sync.capabilities.elastic and self.maybe_stop(done, met=True):
                return self.interrupted(done)  # a stop while joining: no step trained outside the federation
            while done < self.clock.steps:  # this facility's steps (federation.every as a list: its own)
                self.train_step(done)
                stop = self.maybe_round(done + 1)
                done = self.boundary.step  # an elastic facility's round may realign it to the federation's step
                if stop:
                    return self.interrupted(done)
                if self.last:
                    break
        except BaseException:
            self.observer.abort()
            self.sync.close()
            raise
        return self.summarize(done)

    def restore(self) -> None:
        """From the job's checkpoint, if any: the step, the records, the observer's files and W&B runs."""
        saved = self.checkpointer.restore(self.losses) if self.checkpointer is not None else None
        steps = self.clock.facility_steps
        if saved is not None and steps is not None:  # facilities of different paces: this one's own step
            saved = {**saved, "step": steps[self.state.facility], "facility_steps": list(steps)}
        self.restored = saved
        self.start_step = saved["step"] if saved else 0
        # The data's position is the step plus this shift (an elastic facility's step is the federation's).
        self.saved_shift = int(saved.get("records", {}).get("data_shift", 0)) if saved else 0
        self.rounds = [RoundRecord.from_dict(r) for r in saved["rounds"]] if saved else []
        self.evals = list(saved.get("records", {}).get("evals", [])) if saved else []
        cfg = self.cfg
        self.observer = Observer(
            self.tcfg, cfg.strategy, cfg.logger, self.state, self.run_dir, saved, rounds_at=self._rounds_at,
            experiment=cfg.experiment, config=self.config,
        )  # fmt: skip
        self.log = StepLog(self.observer, self.losses, self.state.facility, self.tokens_per_step, self.timer)

    def _rounds_at(self, done: int) -> bool:
        """Whether rounds end after ``done`` steps, as the clock plans it (the progress line looks ahead)."""
        return self.clock.plan(done).rounds

    def begin(self) -> int:
        """The sync's begin: an elastic facility joins here and adopts the federation's step (its data keep
        their own position); then the clock starts and what starts before the first step does. Returns the
        step to train from."""
        step = self.sync.begin(self.start_step)
        self.data_shift, self.first_step = self.saved_shift + self.start_step - step, step
        self.observer.moved(step - self.start_step)
        self.boundary: Boundary = self.clock.start(step)
        self.sync.start(self.boundary, len(self.rounds))
        return step

    # ------------------------------------------------------------------ one step
    def train_step(self, step: int) -> None:
        """Forward and backward of the step's micro-batches, the optimizer step, the facility's mean loss."""
        done, accum = step + 1, self.tcfg.grad_accum
        self.fault.before_step(done)
        at, tokens = step + self.data_shift, 0

        def micro_batch(i: int):  # micro-batch i of step s is batch s * grad_accum + i of the source
            nonlocal tokens
            batch = self.data.train_batch(at * accum + i)
            tokens += batch[1].numel()  # tokens actually trained (federation.weights=tokens)
            return batch

        loss = accumulate_gradients(self.sync.module, micro_batch, self.tcfg, self.state.device, self.timer)
        with self.timer("optimizer"):
            self.step_lr = self.sync.optimizer_step(tokens)
            self.clock.step_taken()
            self.fault.after_step(done, self.model)  # fault.slow_*: the step's own time, X times over
        self.step_loss = loss / self.state.facility_size
        with self.timer("wait"):  # the facility's slowest rank
            dist.all_reduce(self.step_loss, group=self.state.group("facility"))

    def maybe_round(self, done: int) -> bool:
        """After ``done`` steps, one way: what the step is (the clock's :class:`Boundary`), the local evaluation
        at a boundary, what the sync finishes there, :meth:`settle`, then what the sync starts there unless
        training stops. Returns whether training stops here."""
        self.boundary = boundary = self.clock.at(done)
        self.local_eval = eval_points(done, boundary.eval_due, self.tcfg.eval_every)
        self.eval_record = {"step": done, "loss_local": None, "loss_global": None}
        if self.local_eval:
            self.eval_record["loss_local"] = self._facility_eval()
        if self.settle(boundary, self.sync.finish(boundary, len(self.rounds))):
            self.sync.start(self.boundary, len(self.rounds))
        return self.stop_at is not None and self.boundary.step >= self.stop_at and not self.last

    def settle(self, boundary: Boundary, end: StepEnd) -> bool:
        """The trainer's part of the end of a step, once the sync's rounds are made: the records, the global
        evaluation, the log row, a checkpoint, the stop agreement. False: training stops here."""
        done = end.step
        for record in end.rounds:
            self.rounds.append(record)
            self.observer.round(record)
        if end.rounds:
            self.eval_record["loss_global"] = self._facility_eval()
        if self.local_eval:
            self.eval_record["time"] = time.time()  # when it was known: wall-clock time-to-loss (bench.wan)
            self.evals.append(self.eval_record)
        elapsed = time.perf_counter() - self.start
        self.log.add(boundary.step - 1, self.step_loss, self.step_lr, elapsed,
                     self.eval_record if self.local_eval else None, end.metrics)  # fmt: skip
        if done != boundary.step:
            self.boundary = boundary = self._realign(boundary, done)
        self.last = boundary.end or end.ended  # federation.every_s: the round just made may end the job
        if self.local_eval or done % self.tcfg.log_every == 0 or self.last:  # local_eval: every boundary too
            self.log.flush()
        self.maybe_checkpoint(boundary)
        return not self.maybe_stop(done, met=bool(end.rounds))

    def _realign(self, boundary: Boundary, step: int) -> Boundary:
        """An elastic facility's round moved its step counter from ``boundary.step`` to the federation's ``step``
        (it missed rounds, or trained through them): the clock, the end, the checkpoint's step and the steps
        counted as trained follow it; the data keep their position. The boundary as it now stands."""
        moved = step - boundary.step
        self.data_shift -= moved
        self.first_step += moved
        self.observer.moved(moved)
        if self.checkpointer is not None:
            self.checkpointer.saved_step = -1  # a checkpoint of this step, if any, was of another state
        return replace(boundary, step=step, job_step=step, end=step >= self.clock.steps)

    def _records(self) -> dict:
        """What a checkpoint's ``state.json`` keeps beside the rounds: the evaluations and the data's shift."""
        return {"evals": self.evals, "data_shift": self.data_shift}

    def _facility_eval(self) -> list[float]:
        with self.timer("eval"):
            return facility_eval(self.model, self.eval_batches, self.state, self.tcfg.loss_chunk)

    def maybe_checkpoint(self, boundary: Boundary) -> None:
        """After a boundary's rounds (nothing is in flight there: a step's exchanges start after it)."""
        if self.checkpointer is not None and boundary.checkpoint:
            with self.timer("checkpoint"):
                self.checkpointer.after_round(
                    boundary.job_step, self._saved_rounds(), self.losses, final=self.last, records=self._records()
                )

    def _saved_rounds(self) -> list[dict]:
        """The round records as a checkpoint's ``state.json`` keeps them (plain dicts)."""
        return [record.to_dict() for record in self.rounds]

    def maybe_stop(self, done: int, met: bool) -> bool:
        """SIGINT/SIGTERM on any rank: every rank stops at the same step. Where nothing crosses facilities
        between rounds (``quiet_between_rounds``) the request is agreed at rounds only (``met``: one ended
        here), so no message crosses a facility's link on every step; else on every step. Whether training
        stops after this step."""
        signum = None
        if not self.sync.capabilities.quiet_between_rounds or met:
            with self.timer("wait", join=True):  # the rest of this step's wait
                signum = agree_stop()
        if signum:
            self.signum = signum
            if self.stop_at is None:
                self.stop_at = self._stop_step(done)
        return self.stop_at is not None and done >= self.stop_at and not self.last

    def _stop_step(self, done: int) -> int:
        """Collective: where to stop after a stop request seen after ``done`` steps. Checkpoints are exact at
        round boundaries only; the next one when it is at most :data:`STOP_GRACE_S` away (by the slowest rank's
        mean step time), else here. Without checkpoints, elastic or paced (this is a round): here."""
        caps = self.sync.capabilities
        if not caps.checkpoints or caps.elastic or caps.paced:
            return done
        seconds = torch.tensor([(time.perf_counter() - self.start) / (done - self.first_step)], dtype=torch.float64)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        for step in range(done, self.tcfg.steps + 1):
            if self.clock.plan(step).checkpoint:
                return step if (step - done) * float(seconds) <= STOP_GRACE_S else done
        return done

    # ------------------------------------------------------------------ the end
    def interrupted(self, done: int) -> dict | None:
        """Stop after ``done`` steps: a checkpoint at a round boundary, none elsewhere (an elastic facility
        saves at any step: what it rejoins with, and leaves the federation); rank 0 returns
        ``{"interrupted": {...}}`` (what the launcher's one line says)."""
        self.log.flush()
        caps, ckpt = self.sync.capabilities, self.checkpointer
        exact = (self.boundary.checkpoint or caps.elastic) and done > self.start_step  # a restored step is saved
        saved = last = None
        if ckpt is not None:
            if exact:  # no-op if the cadence saved it
                ckpt.save(self.boundary.job_step, self._saved_rounds(), self.losses, records=self._records())
            ckpt.wait()  # published, or raises
            if self.state.rank == 0:
                last = self._last_checkpoint(ckpt)
                saved = last if exact else None
            dist.barrier(group=ckpt.group)
        left = self.sync.leave()
        self.observer.abort()
        if self.state.rank != 0:
            return None
        stop = {"signal": signal_name(self.signum), "step": done, "steps": self.tcfg.steps, "checkpoint": saved,
                "last_checkpoint": last, "run_dir": str(self.run_dir), "left": left}  # fmt: skip
        return {"interrupted": stop}

    @staticmethod
    def _last_checkpoint(ckpt: Checkpointer) -> str | None:
        from ..checkpoint.store import latest_checkpoint, remove_stale

        remove_stale(ckpt.dir)  # temporaries of an interrupted save
        latest = latest_checkpoint(ckpt.dir)
        return str(latest) if latest else None

    def summarize(self, done: int) -> dict | None:
        """After the last step: every copy the same model, evaluated and measured; rank 0's summary."""
        train_seconds = time.perf_counter() - self.start
        reported = self.sync.close()
        if self.checkpointer is not None:
            reported["checkpoints"] = self.checkpointer.close()
        state, tcfg = self.state, self.tcfg
        eval_loss = evaluate(self.model, self.eval_batches, state.device, tcfg.loss_chunk)
        divergence = max_param_divergence(self.model, state)
        forward_dtype = forward_param_dtype(self.model)  # collective over the facility (one block's all-gather)
        gather_facility_losses(self.losses, state)
        phases = gather_phase_table(self.timer, state, done - self.first_step)
        if self.cfg.export.hf:
            from ..checkpoint.hf import export_job

            export_job(self.model, state, self.run_dir, self.cfg.export, self.cfg.data, base_model=self.cfg.model.path)
        self._round_times()
        facility_steps, trained = self._trained(done)
        if state.rank != 0:
            self.observer.finish(None)
            return None
        summary = job_summary(
            self.cfg.experiment, state, losses=self.losses, steps=max(facility_steps or [done]), trained_steps=trained,
            tokens_per_step=self.tokens_per_step, train_seconds=train_seconds,
            train_started_at=self.train_started_at, started_at=self.started_at, eval_loss=eval_loss,
            evals=self.evals, divergence=divergence, phases=phases, setup_rss=self.setup_rss, rounds=self.rounds,
            facility_steps=facility_steps, forward_param_dtype=forward_dtype, **reported,
        )  # fmt: skip
        self.observer.finish(summary)
        return summary

    def _round_times(self) -> None:
        """Each round's seconds: the slowest rank's; its ``waited_s``: each facility's wait at it for the others (its
        slowest rank's). Rounds a resume restored carry rank 0's wait from state.json, so each facility's column
        there holds facility 0's: approximate for those rounds."""
        agg = torch.tensor([r.seconds for r in self.rounds], dtype=torch.float64)
        dist.all_reduce(agg, op=dist.ReduceOp.MAX)
        waited = torch.zeros(len(self.rounds), self.state.num_facilities, dtype=torch.float64)
        for i, record in enumerate(self.rounds):
            if record.has("waited"):
                waited[i, self.state.facility], record.waited = record.waited, UNSET
        dist.all_reduce(waited, op=dist.ReduceOp.MAX)
        for record, seconds, wait in zip(self.rounds, agg.tolist(), waited.tolist()):
            record.seconds = seconds
            if not record.has("waited_s"):
                record.waited_s = wait

    def _trained(self, done: int) -> tuple[list[int] | None, int | list[int]]:
        """Every facility's steps so far (facilities of different paces; else None), and the steps trained in
        this job: this facility's, or with different paces every facility's (for the job's tokens)."""
        steps = self.clock.facility_steps
        if steps is None:
            return None, done - self.first_step
        before = self.restored.get("facility_steps") if self.restored else None
        return list(steps), [n - (before[f] if before else 0) for f, n in enumerate(steps)]
