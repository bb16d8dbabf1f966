"""What keeps the copies of the model in step: the one seam between the trainer and everything else.

The :class:`~.trainer.Trainer` runs the same steps for every job and calls a :class:`Sync` at two
points of each, the way torchft's ``LocalSGD``/``DiLoCo`` hook into a plain training loop:

=================================  ==============================================================
``module``                         what the step runs forward and backward on; it takes the
                                   micro-batch switch (``set_requires_gradient_sync``)
``capabilities``                   what the trainer may rely on (:class:`Capabilities`)
``optimizer_step(tokens)``         after the step's backward passes (``tokens`` trained in them):
                                   inner optimizer(s), gradient sync; the step's learning rate
``on_step_end(done, index, then)`` after ``done`` steps: whatever happens there (a join before
                                   the first step, a round's wait and exchange, fragments, metrics),
                                   ``then(end)`` (the trainer evaluates, logs, checkpoints, agrees
                                   on a stop), then what starts there (overlapped exchanges,
                                   algorithm switches) unless ``then`` said stop
``state_dict()``/``load_state_dict()``  the federation's state in the job's checkpoints
``leave()``                        at a stop: leave the federation; the line saying how to rejoin
``close()``                        after the loop when it ends or fails (a stop calls ``leave()``
                                   instead); what the summary adds
=================================  ==============================================================

When rounds, the end and a checkpoint's step fall is the round clock's
(:class:`xffl_like.federation.clock.RoundClock`), which the trainer holds beside the sync.

Three implementations, built by :func:`~.trainer.build_trainer`: :class:`FederatedSync`
(``parallel=fsdp``: FSDP2/HSDP inside a facility, the federation's rounds across facilities),
:class:`~.elastic.ElasticSync` (``federation.elastic.hub``: this job is one facility; rounds
among the facilities present) and :class:`~.dataparallel.DataParallelSync`
(``parallel=decentralized|bagua``: a full copy per rank kept in step by :mod:`xffl_like.parallel`).
The first two compose the same :class:`ShardedParts`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..aggregation import build_strategy
from ..checkpoint.dcp import checkpoint_dir
from ..config.schema import JobConfig
from ..distributed.state import DistributedState
from ..federation import FederationSchedule
from ..federation.pace import facility_steps
from ..federation.protocol import Rounds
from ..observe.timing import PhaseTimer
from .nonfinite import NonFiniteGuard
from .optim import build_optimizer, build_scheduler, schedule_at
from .parallelize import build_sharded_model, contiguous_shards
from .round_dump import round_observers
from .speed import compile_blocks, compiles, compute_dtype

__all__ = ["Capabilities", "FederatedSync", "RoundHooks", "ShardedParts", "StepEnd", "Sync", "SyncBase"]


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
    """What happened after a step: the round records to log and keep, extra values for the step's log row."""

    step: int  # the step training continues from (an elastic joiner: the federation's)
    rounds: list[dict] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)


#: The trainer's part of the end of a step (evaluate, log, checkpoint, agree on a stop): False to stop there.
Settle = Callable[[StepEnd], bool]


class Sync(Protocol):
    """Keeps the copies of the model in step; see the module docstring for when each member is called."""

    module: nn.Module
    capabilities: Capabilities

    def optimizer_step(self, tokens: int) -> float: ...
    def on_step_end(self, done: int, index: int, then: Settle) -> StepEnd: ...
    def state_dict(self, at_step: int | None = None) -> dict: ...
    def load_state_dict(self, sd: dict) -> None: ...
    def leave(self) -> str | None: ...
    def close(self) -> dict: ...


class SyncBase:
    """Defaults for a :class:`Sync`: an implementation overrides what it changes. The first
    :meth:`on_step_end` is the start (after the restored step, before the first step trained)."""

    capabilities = Capabilities()
    started = False

    def on_step_end(self, done: int, index: int, then: Settle) -> StepEnd:
        if not self.started:
            self.started = True
            return self.start(done, index)
        end = StepEnd(done, self.finish_due(done, index), self.metrics(done))
        if then(end):
            self.start_due(done, index + len(end.rounds))
        return end

    def start(self, done: int, index: int) -> StepEnd:
        """Before the first step of this job, after ``done`` (restored) steps."""
        return StepEnd(done)

    def finish_due(self, done: int, index: int) -> list[dict]:
        """The rounds that end after ``done`` steps (records numbered from ``index``)."""
        return []

    def metrics(self, done: int) -> dict:
        """Extra values for the log row of step ``done``."""
        return {}

    def start_due(self, done: int, index: int) -> None:
        """What starts after ``done`` steps, once the step is settled."""

    def state_dict(self, at_step: int | None = None) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass

    def leave(self) -> str | None:
        return None

    def close(self) -> dict:
        return {}


class RoundHooks:
    """What a federation calls around each round: the non-finite guard sets its weights, observers
    (:func:`~.round_dump.round_observers`: those registered in :data:`~.round_dump.OBSERVERS`, by tests)
    see the values around it."""

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
        optimizer = build_optimizer(model, cfg.optim)
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
        self, state: DistributedState, parts: ShardedParts, rounds: Rounds, hooks: RoundHooks, timer: PhaseTimer,
        *, paced: bool, strategy: dict, rounds_only: bool = False,
    ):  # fmt: skip
        """``rounds``: the federation (:class:`~xffl_like.federation.protocol.Rounds`) built with ``hooks``;
        ``paced``: facilities take different steps per round; ``strategy``: the summary's ``strategy``;
        ``rounds_only``: facilities meet at rounds only (no ``synchronous`` phase averaging every step)."""
        self.state, self.parts, self.rounds, self.hooks, self.timer = state, parts, rounds, hooks, timer
        self.module, self.clock, self.strategy = parts.model, rounds.clock, strategy
        quiet = paced or (state.num_facilities > 1 and rounds_only)
        self.capabilities = Capabilities(checkpoints=True, paced=paced, quiet_between_rounds=quiet)
        # This facility's own schedule (a checkpoint's state.json holds rank 0's: facility 0's, when paces differ).
        self._own_schedules = [dict(fn.__dict__) for fn in parts.scheduler.lr_lambdas]

    @classmethod
    def build(
        cls, cfg: JobConfig, state: DistributedState, parts: ShardedParts, run_dir: Path, timer: PhaseTimer, phases
    ) -> FederatedSync:
        """The job's: the non-finite guard and round observers, the strategy and the federation of ``phases``
        (the launcher's plan, :class:`~xffl_like.config.plan.WorkerPlan`). Collective."""
        where = checkpoint_dir(cfg.checkpoint, run_dir)
        guard = NonFiniteGuard(cfg.federation.on_nonfinite, state, parts.model, parts.optimizer, where)
        hooks = RoundHooks(guard, round_observers(parts.model, state))
        strategy = build_strategy(parts.model, state, cfg.strategy)
        rounds = FederationSchedule(
            cfg.federation, parts.model, strategy, state, cfg.train.steps, hooks, phases=phases
        )  # fmt: skip
        described = {"name": cfg.strategy.name, "streams": cfg.strategy.streams}
        fed = cfg.federation
        rounds_only = fed.algorithm != "synchronous" and not fed.schedule  # a schedule may switch to synchronous
        return cls(state, parts, rounds, hooks, timer, paced=fed.paced, strategy=described, rounds_only=rounds_only)

    def start(self, done: int, index: int) -> StepEnd:
        self.clock.start(done)
        if done == 0:
            self.hooks.save(0, "init")  # tests: the common start, theta_global of every fragment
        self.start_due(done, index)  # an exchange overlapping the first steps (after a resume: as the saved run did)
        return StepEnd(done)

    def optimizer_step(self, tokens: int) -> float:
        self.rounds.trained(tokens)  # federation.weights=tokens
        self.rounds.after_backward()  # synchronous: gradients averaged across facilities
        self.parts.step()
        return self.parts.lr()

    def finish_due(self, done: int, index: int) -> list[dict]:
        if not self.rounds.applies_at(done):
            return []
        # Every facility at the round first: this rank's wait, its share of the round's waited_s (what a slower
        # facility costs the others), is one aggregation iteration with the exchange; the round's seconds time
        # the exchange alone.
        with self.timer("aggregation"):
            arrived = time.perf_counter()
            dist.barrier()
            waited = time.perf_counter() - arrived
        with self.timer("aggregation", join=True):
            records = self.rounds.finish_due(done, index)
        return [{**record, "waited": waited} for record in records]

    def start_due(self, done: int, index: int) -> None:
        if self.rounds.starts_at(done):  # exchanges overlapping the next steps start after the step's checkpoint
            with self.timer("aggregation"):
                self.rounds.start_due(done, index)

    def state_dict(self, at_step: int | None = None) -> dict:
        """The federation's state; ``at_step``: of the phase that runs after that step (the template a
        checkpoint of that step loads into)."""
        if at_step is not None:
            self.rounds.resume_at(at_step)
        return self.rounds.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.rounds.load_state_dict(sd)
        steps = self.clock.facility_steps
        if steps is None:
            return
        # A checkpoint is named by the job's step; this facility resumes at its own, on its own schedule.
        scheduler = self.parts.scheduler
        for fn, schedule in zip(scheduler.lr_lambdas, self._own_schedules):
            fn.__dict__.update(schedule)
        schedule_at(scheduler, steps[self.state.facility])

    def close(self) -> dict:
        return {"strategy": self.strategy, "federation": self.rounds.describe()}


def sharded_steps(cfg: JobConfig, state: DistributedState) -> int:
    """This facility's steps in the job (``federation.every`` as a list: its own rounds x its entry)."""
    return facility_steps(cfg.federation, state.facility, cfg.train.steps)
