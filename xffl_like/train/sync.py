"""What keeps the copies of the model in step: the one seam between the trainer and everything else.

The :class:`~.trainer.Trainer` runs the same steps for every job and calls a :class:`Sync` at fixed points
of each, one way (the sync never calls back into the trainer), the way torchft's ``LocalSGD``/``DiLoCo``
hook into a plain training loop. Once per step the trainer asks the round clock what the step is (a
:class:`~xffl_like.federation.protocol.Boundary`), then:

======================================  =========================================================
``module``                              what the step runs forward and backward on; it takes the
                                        micro-batch switch (``set_requires_gradient_sync``)
``capabilities``                        what the trainer may rely on (:class:`Capabilities`)
``begin(done)``                         before the first step, after ``done`` restored steps: a
                                        join; returns the step training continues from
``optimizer_step(tokens)``              after the step's backward passes (``tokens`` trained in them):
                                        inner optimizer(s), gradient sync; the step's learning rate
``finish(boundary, index)``             after the step: what ends there (a round's wait and exchange,
                                        fragments, a phase switch, metrics), as a :class:`StepEnd`;
                                        the trainer then evaluates, logs, checkpoints, agrees on a stop
``start(boundary, index)``              then, unless it stops there: what starts there (overlapped
                                        exchanges, algorithm switches; before the first step the
                                        clock's start boundary)
``state_dict()``/``load_state_dict()``  the federation's state in the job's checkpoints
``leave()``                             at a stop: leave the federation; the line saying how to rejoin
``close()``                             after the loop when it ends or fails (a stop calls ``leave()``
                                        instead); what the summary adds
======================================  =========================================================

What each step is (rounds, a phase switch, exchanges that start, the end, a checkpoint's step) is the round
clock's (:class:`xffl_like.federation.protocol.RoundClock`), which the trainer holds beside the sync.

Three implementations, built by :func:`~.trainer.build_parts`: :class:`FederatedSync`
(``parallel=fsdp``: FSDP2/HSDP inside a facility, the federation's rounds across facilities),
:class:`~.elastic.ElasticSync` (``federation.elastic.hub``: this job is one facility; rounds
among the facilities present) and :class:`~.dataparallel.DataParallelSync`
(``parallel=decentralized|bagua``: a full copy per rank kept in step by :mod:`xffl_like.parallel`).
The first two compose the same :class:`ShardedParts`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..aggregation import build_strategy
from ..checkpoint.store import checkpoint_dir
from ..config.schema import JobConfig
from ..distributed.state import DistributedState
from ..federation import FederationSchedule
from ..federation.pace import facility_steps
from ..federation.protocol import Boundary, RoundClock, Rounds
from ..federation.record import RoundRecord
from ..observe.timing import PhaseTimer
from .nonfinite import NonFiniteGuard
from .observers import round_observers
from .optim import build_optimizer, build_scheduler, schedule_at
from .parallelize import build_sharded_model, contiguous_shards
from .speed import compile_blocks, compiles, compute_dtype

__all__ = ["Capabilities", "FederatedSync", "ShardedParts", "StepEnd", "Sync", "SyncBase", "TrainerHooks"]


@dataclass(frozen=True)
class Capabilities:
    """What a sync declares, so that the trainer never asks what kind it has."""

    #: Exact checkpoints at round boundaries: a stop request goes on to the next one when it is near.
    checkpoints: bool = False
    #: One facility of a federation of independent jobs: it stops at any step and leaves the federation.
    elastic: bool = False
    #: Facilities take different steps between rounds: no collective of every rank in between (stops agree at rounds).
    paced: bool = False
    #: Nothing crosses facilities between rounds: a stop request is agreed across facilities at round boundaries
    #: only (paced rounds, and rounds of a fixed ``every`` among several facilities), never on every step.
    quiet_between_rounds: bool = False


@dataclass
class StepEnd:
    """What ended after a step: the round records to log and keep, extra values for the step's log row."""

    step: int  # the step training continues from
    rounds: list[RoundRecord] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    #: A round's outcome ended the job here (an elastic facility with ``every_s``: the round's quorum says a
    #: facility reached ``train.steps``), beside the clock's own end.
    ended: bool = False


class Sync(Protocol):
    """Keeps the copies of the model in step; see the module docstring for when each member is called."""

    module: nn.Module
    capabilities: Capabilities

    def begin(self, done: int) -> int: ...
    def optimizer_step(self, tokens: int) -> float: ...
    def finish(self, boundary: Boundary, index: int) -> StepEnd: ...
    def start(self, boundary: Boundary, index: int) -> None: ...
    def state_dict(self, at_step: int | None = None) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...
    def leave(self) -> str | None: ...
    def close(self) -> dict: ...


class SyncBase:
    """Defaults for a :class:`Sync`: an implementation overrides what it changes."""

    capabilities = Capabilities()

    def begin(self, done: int) -> int:
        """Before the first step of this job, after ``done`` (restored) steps: the step to train from."""
        return done

    def finish(self, boundary: Boundary, index: int) -> StepEnd:
        """What ends at ``boundary`` (round records numbered from ``index``); here the step's metrics."""
        return StepEnd(boundary.step, [], self.metrics(boundary.step))

    def metrics(self, done: int) -> dict:
        """Extra values for the log row of step ``done``."""
        return {}

    def start(self, boundary: Boundary, index: int) -> None:
        """What starts at ``boundary``, once the step is settled."""

    def state_dict(self, at_step: int | None = None) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def leave(self) -> str | None:
        return None

    def close(self) -> dict:
        return {}


class TrainerHooks:
    """The training side's :class:`~xffl_like.federation.protocol.RoundHooks`: the non-finite guard sets a
    round's weights, observers (:func:`~.observers.round_observers`: those registered in
    :data:`~.observers.OBSERVERS`, by tests) see the values around it."""

    def __init__(self, guard: NonFiniteGuard | None, observers: list):
        self.guard, self.observers = guard, observers

    def weights_for_round(self, weights: list[float] | None, index: int, done: int):
        if self.guard is None:
            return weights, []
        return self.guard.weights_for_round(weights, index, done)

    def save(self, round_: int, phase: str, **extra) -> None:
        for observer in self.observers:
            observer.save(round_, phase, **extra)


@dataclass
class ShardedParts:
    """A facility's FSDP2/HSDP model (the same start on every rank), its inner optimizer and learning-rate
    schedule over ``steps``: what :class:`FederatedSync` and :class:`~.elastic.ElasticSync` share."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    grad_clip: float

    @classmethod
    def build(cls, cfg: JobConfig, state: DistributedState, steps: int) -> ShardedParts:
        """Collective: every rank builds them at the same point."""
        dtype = compute_dtype(cfg.train.dtype, state.device)  # auto: bfloat16 on CUDA, float32 on CPU
        model = build_sharded_model(cfg.model, state, dtype, seed=cfg.seed, offload=cfg.parallel.cpu_offload)
        contiguous_shards(model, state.shard_size)  # buckets become views (model.init=meta: already laid out so)
        if compiles(cfg.train.compile, state.device):  # auto: on CUDA
            compile_blocks(model)
        optimizer = build_optimizer(model, cfg.optim, offload=cfg.parallel.cpu_offload)
        return cls(model, optimizer, build_scheduler(optimizer, cfg.optim, steps), cfg.optim.grad_clip)

    def step(self) -> None:
        """Clip, step, zero the gradients, advance the schedule."""
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


class FederatedSync(SyncBase):
    """``parallel=fsdp``: the model sharded over the facility, an inner optimizer per rank, the
    federation's rounds across facilities (:mod:`xffl_like.federation`) with the non-finite guard
    before each. Collective: every rank builds it at the same point."""

    def __init__(
        self, state: DistributedState, parts: ShardedParts, rounds: Rounds, clock: RoundClock, hooks: TrainerHooks,
        timer: PhaseTimer, *, paced: bool, strategy: dict, rounds_only: bool = False,
    ):  # fmt: skip
        """``rounds``: the federation (:class:`~xffl_like.federation.protocol.Rounds`) built with ``hooks``;
        ``clock``: what each of its steps is; ``paced``: facilities take different steps per round;
        ``strategy``: the summary's ``strategy``; ``rounds_only``: facilities meet at rounds only (no
        ``synchronous`` phase averaging every step)."""
        self.state, self.parts, self.rounds, self.hooks, self.timer = state, parts, rounds, hooks, timer
        self.module, self.clock, self.strategy = parts.model, clock, strategy
        quiet = paced or (state.num_facilities > 1 and rounds_only)
        self.capabilities = Capabilities(checkpoints=True, paced=paced, quiet_between_rounds=quiet)
        # This facility's own schedule (a checkpoint's state.json holds rank 0's: facility 0's, when paces differ).
        self._own_schedules = [dict(fn.__dict__) for fn in parts.scheduler.lr_lambdas]

    @classmethod
    def build(
        cls, cfg: JobConfig, state: DistributedState, parts: ShardedParts, run_dir: Path, timer: PhaseTimer, phases
    ) -> FederatedSync:
        """The job's: the non-finite guard and round observers, the strategy and the federation of ``phases``
        (the launcher's plan, :class:`~xffl_like.config.plan.WorkerPlan`) with its clock. Collective."""
        where = checkpoint_dir(cfg.checkpoint, run_dir)
        guard = NonFiniteGuard(cfg.federation.on_nonfinite, state, parts.model, parts.optimizer, where)
        hooks = TrainerHooks(guard, round_observers(parts.model, state))
        strategy = build_strategy(parts.model, state, cfg.strategy)
        rounds = FederationSchedule(
            cfg.federation, parts.model, strategy, state, cfg.train.steps, hooks, phases=phases
        )  # fmt: skip
        described = {"name": cfg.strategy.name, "streams": cfg.strategy.streams}
        fed = cfg.federation
        rounds_only = fed.algorithm != "synchronous" and not fed.schedule  # a schedule may switch to synchronous
        return cls(
            state, parts, rounds, rounds.clock, hooks, timer, paced=fed.paced, strategy=described,
            rounds_only=rounds_only,
        )  # fmt: skip

    def begin(self, done: int) -> int:
        if done == 0:
            self.hooks.save(0, "init")  # tests: the common start, theta_global of every fragment
        return done

    def optimizer_step(self, tokens: int) -> float:
        self.rounds.trained(tokens)  # federation.weights=tokens
        self.rounds.after_backward()  # synchronous: gradients averaged across facilities
        self.parts.step()
        return self.parts.lr()

    def finish(self, boundary: Boundary, index: int) -> StepEnd:
        if not boundary.rounds:
            return StepEnd(boundary.step)
        # Every facility at the round first: this rank's wait, its share of the round's waited_s (what a slower
        # facility costs the others), is one aggregation iteration with the exchange; the round's seconds time
        # the exchange alone.
        with self.timer("aggregation"):
            arrived = time.perf_counter()
            dist.barrier()
            waited = time.perf_counter() - arrived
        with self.timer("aggregation", join=True):
            records = self.rounds.finish(boundary, index)
            if boundary.finish:
                self.clock.round_done(boundary.step)
        for record in records:
            record.waited = waited
        return StepEnd(boundary.step, records)

    def start(self, boundary: Boundary, index: int) -> None:
        # Exchanges overlapping the next steps start after the step's checkpoint (at the start: after a resume,
        # as the saved run did).
        if boundary.start:
            with self.timer("aggregation"):
                self.rounds.start(boundary, index)

    def state_dict(self, at_step: int | None = None) -> dict:
        """The federation's state; ``at_step``: of the phase that runs after that step (the template a
        checkpoint of that step loads into)."""
        if at_step is not None:
            self.rounds.resume_at(at_step)
        return {**self.rounds.state_dict(), **self.clock.state_dict()}  # facility_steps, when paces differ

    def load_state_dict(self, sd: dict) -> None:
        self.rounds.load_state_dict(sd)
        self.clock.load_state_dict(sd)
        steps = self.clock.facility_steps
        if steps is None:
            return
        # A checkpoint is named by the job's step; this facility resumes at its own, on its own schedule.
        scheduler = self.parts.scheduler
        for fn, schedule in zip(scheduler.lr_lambdas, self._own_schedules):
            fn.__dict__.update(schedule)
        schedule_at(scheduler, steps[self.state.facility])

    def close(self) -> dict:
        return {"strategy": self.strategy, "federation": {**self.rounds.describe(), **self.rounds.message_stats()}}


def sharded_steps(cfg: JobConfig, state: DistributedState) -> int:
    """This facility's steps in the job (``federation.every`` as a list: its own rounds x its entry)."""
    return facility_steps(cfg.federation, state.facility, cfg.train.steps)
