"""What keeps the copies of the model in step: the one interface the worker loop calls.

:mod:`.loop` runs the same skeleton for every job (local steps, evaluations, logging, the
summary) and calls a :class:`Sync` at fixed points of each step, the way torchft's
``LocalSGD``/``DiLoCo`` hook into a plain training loop:

============================  =================================================================
``module``                    what the step runs forward and backward on
``data_seed``                 the seed of the batches this facility draws
``begin(step, rounds)``       before the first step: the step to train from (an elastic joiner's differs)
``trained(tokens)``           after each micro-batch: tokens actually trained
``optimizer_step()``          after the step's backward passes: inner optimizer(s), gradient sync
``lr()``                      the learning rate of the step just taken
``boundary_at(done)``         evaluate the local model after ``done`` steps
``applies_at(done)``          a round (or a phase switch) ends after ``done`` steps
``arrive(done)``              there, first: wait for the others (the round's ``waited_s``)
``finish_due(done, index)``   end the due rounds: their records
``metrics(done)``             extra values for this step's log row
``end_step(done, ...)``       after the step's logging: checkpoints
``start_due(done, index)``    where ``starts_at(done)``: exchanges that start, algorithm switches
``ends_at(done)``             training ends after ``done`` steps (``federation.every_s``: decided at a round)
``job_step(done)``            the job's step a checkpoint is named by (``done``, unless facilities' steps differ)
``finish()``                  after the last step: every copy the same model; what the summary adds
``close()``                   after the loop, however it ended (an elastic facility leaves)
============================  =================================================================

Three implementations: :class:`FederatedSync` (``parallel=fsdp``: FSDP2/HSDP inside a facility,
the federation's rounds across facilities, checkpoints) and
:class:`~.dataparallel.DataParallelSync` (``parallel=decentralized|bagua``: a full copy per rank
kept in step by :mod:`xffl_like.parallel`), and :class:`~.elastic.ElasticSync`
(``federation.elastic.lighthouse``: this job is one facility; rounds among the facilities present).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from ..aggregation import build_strategy
from ..checkpoint import Checkpointer
from ..distributed.state import DistributedState
from ..federation import FederationSchedule
from ..federation.pace import facility_steps
from ..schema import JobConfig
from .nonfinite import NonFiniteGuard
from .optim import build_optimizer, build_scheduler
from .parallelize import build_sharded_model, contiguous_shards
from .round_dump import RoundDump

__all__ = ["FederatedSync", "Sync"]


class Sync(Protocol):
    """Keeps the copies of the model in step; see the module docstring for when each is called."""

    model: nn.Module  # this rank's model: evaluated, measured and exported
    module: nn.Module  # what the training step calls (the model, or a wrapper of it)
    ckpt: Checkpointer | None  # the job's checkpoints (None: this kind of job writes none)

    data_seed: int  # the seed of the batches this facility draws
    data_facility: tuple[int, int] | None  # (facility, facilities) in the data, if not the layout's
    steps: int  # this facility's steps in the job (federation.every as a list: its own)
    paced: bool  # facilities take different steps between rounds: no collective of every rank in between

    def restore(self, losses: torch.Tensor) -> dict | None: ...
    def begin(self, start_step: int, rounds: int) -> int: ...
    def trained(self, tokens: int) -> None: ...
    def optimizer_step(self) -> None: ...
    def lr(self) -> float: ...
    def boundary_at(self, done: int) -> bool: ...
    def applies_at(self, done: int) -> bool: ...
    def arrive(self, done: int) -> None: ...
    def finish_due(self, done: int, index: int) -> list[dict]: ...
    def metrics(self, done: int) -> dict: ...
    def end_step(self, done: int, rounds: list[dict], losses: torch.Tensor, evals: list[dict]) -> None: ...
    def starts_at(self, done: int) -> bool: ...
    def start_due(self, done: int, index: int) -> None: ...
    def ends_at(self, done: int) -> bool: ...
    def job_step(self, done: int) -> int: ...
    def finish(self) -> dict: ...
    def close(self) -> None: ...


class FederatedSync:
    """``parallel=fsdp``: the model sharded over the facility (FSDP2, HSDP with replicas), an inner
    optimizer per rank, the federation's rounds across facilities (:mod:`xffl_like.federation`),
    the non-finite guard before each round and a DCP checkpoint after each boundary.

    Collective: every rank builds it at the same point.
    """

    def __init__(self, cfg: JobConfig, state: DistributedState, run_dir: Path, config: dict):
        """``config``: the whole resolved job config as plain values (recorded in each checkpoint)."""
        tcfg, ocfg = cfg.train, cfg.optim
        self.state, self.grad_clip = state, ocfg.grad_clip
        # This facility's steps (federation.every as a list: its own number of rounds x its entry).
        self.steps = facility_steps(cfg.federation, state.facility, tcfg.steps)
        self.paced = cfg.federation.paced  # facilities take different steps per round (federation/pace.py)
        self.waited = 0.0  # this rank's wait at the last round for the other facilities
        self.model = self.module = build_sharded_model(cfg.model, state, tcfg.dtype, seed=cfg.seed)  # same start
        contiguous_shards(self.model, state.shard_size)  # aggregation buckets become views: no copies
        self.optimizer = build_optimizer(self.model, ocfg)
        self.scheduler = build_scheduler(self.optimizer, ocfg, self.steps)
        self.strategy = {"name": cfg.strategy.name, "streams": cfg.strategy.streams}
        self.federation = self._federation(cfg, state)
        self.data_seed = cfg.seed  # which batches this facility draws (with its index in the layout)
        self.data_facility = None  # the layout's facility index and count
        self.dump = RoundDump(self.model, state)  # tests only ($XFFL_TEST_DUMP_ROUNDS): values around each round
        self.ckpt = Checkpointer(
            cfg.checkpoint,
            state,
            run_dir,
            self.model,
            self.optimizer,
            self.scheduler,
            self.federation,
            resume=cfg.resume,
            config=config,
        )
        self.guard = NonFiniteGuard(cfg.federation.on_nonfinite, state, self.model, self.optimizer, self.ckpt.dir)

    def _federation(self, cfg: JobConfig, state: DistributedState):
        """What runs the rounds across facilities (collective)."""
        strategy = build_strategy(self.model, state, cfg.strategy)
        return FederationSchedule(cfg.federation, self.model, strategy, state, cfg.train.steps)

    def _adjust(self, done: int):
        """The non-finite guard sets the weights of a round ending or starting after ``done`` steps."""
        return lambda weights, index: self.guard.weights_for_round(weights, index, done)

    def restore(self, losses: torch.Tensor) -> dict | None:
        schedules = [dict(fn.__dict__) for fn in self.scheduler.lr_lambdas]  # this facility's own
        saved = self.ckpt.restore(losses)  # None: a fresh start
        if saved is None or not self.paced:
            return saved
        # A checkpoint is named by the job's step; this facility resumes at its own, on its own schedule
        # (state.json holds rank 0's scheduler: facility 0's steps and position).
        steps = self.federation.facility_steps.tolist()
        own = steps[self.state.facility]
        for fn, schedule in zip(self.scheduler.lr_lambdas, schedules):
            fn.__dict__.update(schedule)
        self.scheduler.last_epoch = own - 1
        self.scheduler.step()
        return {**saved, "step": own, "facility_steps": steps}

    def begin(self, start_step: int, rounds: int) -> int:
        self.federation.start_clock(start_step)
        if start_step == 0:
            self.dump.save(0, "init")  # tests: the common start, theta_global of every fragment
        # An exchange overlapping the first steps starts now (after a resume: as the saved run did).
        self.federation.start_due(start_step, self._adjust(start_step), self.dump, rounds)
        return start_step

    def trained(self, tokens: int) -> None:
        self.federation.trained(tokens)  # tokens actually trained (federation.weights=tokens)

    def optimizer_step(self) -> None:
        self.federation.after_backward()  # synchronous: gradients averaged across facilities
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def boundary_at(self, done: int) -> bool:
        return self.federation.boundary_at(done)  # synchronous: every `every` steps

    def applies_at(self, done: int) -> bool:
        return self.federation.applies_at(done)  # synchronous runs have no rounds (but a phase switch)

    def finish_due(self, done: int, index: int) -> list[dict]:
        # Ranks arrive at different times; the wait is charged to the loop's aggregation phase
        # (and shows as imbalance), the round's seconds time the exchange alone.
        dist.barrier()
        return [
            {**record, "waited": self.waited}
            for record in self.federation.finish_due(done, self._adjust(done), self.dump, index)
        ]

    def arrive(self, done: int) -> None:
        """Where ``applies_at(done)``, before the round's evaluation: wait until every facility is at the
        round (collective). The wait, this rank's share of the round's ``waited_s``, is what a slower
        facility costs the others."""
        arrived = time.perf_counter()
        dist.barrier()
        self.waited = time.perf_counter() - arrived

    def ends_at(self, done: int) -> bool:
        """Whether this facility's training ends after its ``done`` steps."""
        return self.federation.ends_at(done)

    def job_step(self, done: int) -> int:
        """The job's step (what a checkpoint is named by) after this facility's ``done`` steps."""
        return self.federation.job_step(done)

    def metrics(self, done: int) -> dict:
        return {}

    def end_step(self, done: int, rounds: list[dict], losses: torch.Tensor, evals: list[dict]) -> None:
        if self.federation.boundary_at(done):  # nothing is in flight here: a step's exchanges start after it
            self.ckpt.after_round(
                self.job_step(done), rounds, losses, final=self.ends_at(done), records={"evals": evals}
            )

    def starts_at(self, done: int) -> bool:
        return self.federation.starts_at(done)

    def start_due(self, done: int, index: int) -> None:
        self.federation.start_due(done, self._adjust(done), self.dump, index)

    def finish(self) -> dict:
        return {"strategy": self.strategy, "federation": self.federation.describe(), "checkpoints": self.ckpt.close()}

    def close(self) -> None:
        """After the loop, whether it finished, stopped or failed."""
