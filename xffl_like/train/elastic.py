"""``federation.elastic.lighthouse``: this job is one facility of a federation of independent jobs.

:class:`ElasticSync` is :class:`~.sync.FederatedSync` (FSDP2/HSDP inside the facility, the inner
optimizer, checkpoints) whose rounds are :class:`~xffl_like.federation.elastic.exchange.ElasticFederation`'s:
among the facilities present at each boundary, by the Lighthouse's quorum. Before the first step
the facility joins: it heals from a live facility and adopts the federation's step (its data
position and inner optimizer stay its own: from its checkpoint, or fresh). A joiner whose inner
optimizer is fresh (no checkpoint of its own) warms its learning rate up again from its join step
(``federation.elastic.rewarm``), as any fresh optimizer does at step 0.

Data: every facility is facility 0 of its own world, so its identity in the data is its name's: a
synthetic source keeps the job's seed (its shared chain is the federation's, as ``data.non_iid``
says) and takes a number from the name as its facility (its own chain and batches); a corpus is
read whole by every facility, its windows drawn with the job's seed plus that number.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from torch import nn

from ..distributed.state import DistributedState
from ..federation.elastic import facility_name
from ..federation.elastic.exchange import ElasticFederation
from ..federation.pace import RoundPace
from ..schema import JobConfig
from .sync import FederatedSync

__all__ = ["ElasticSync"]


class ElasticSync(FederatedSync):
    """Rounds among the facilities present; joins in :meth:`begin`, leaves in :meth:`close`."""

    def __init__(self, cfg: JobConfig, state: DistributedState, run_dir: Path, config: dict):
        self.name = facility_name(cfg.federation.elastic)
        self.every = cfg.federation.every  # None with federation.every_s
        super().__init__(cfg, state, run_dir, config)
        # federation.every_s: this facility's rounds end by its own step time (federation/pace.py)
        self.pace = RoundPace(cfg.federation, state, self.steps) if cfg.federation.every_s is not None else None
        self.paced = False  # this world is one facility: its ranks step together (and stop at any step)
        # Every facility is facility 0 of its own world: its data differ by its name (module docstring).
        identity = zlib.crc32(self.name.encode()) % (1 << 31)
        if cfg.data.name == "synthetic":
            self.data_facility = (identity, 1 << 31)  # (facility, facilities) for build_data
        else:
            self.data_seed = cfg.seed + identity
        self.data_shift = 0  # batch index = step + data_shift (a joiner keeps its own data position)
        self.left = False
        self.rewarm = cfg.federation.elastic.rewarm and cfg.optim.warmup_steps > 0
        self.warmup_steps = cfg.optim.warmup_steps
        self.fresh_optimizer = True  # no checkpoint restored
        self.rewarm_from: int | None = None  # the join step a fresh optimizer warms up again from
        self.step_lr = self.optimizer.param_groups[0]["lr"]  # the learning rate of the step just taken

    def restore(self, losses):
        restored = super().restore(losses)
        self.fresh_optimizer = restored is None
        return restored

    def _federation(self, cfg: JobConfig, state: DistributedState):
        return ElasticFederation(cfg.federation, self.model, state, self.name, self.steps)

    def begin(self, start_step: int, rounds: int) -> int:
        step = self.federation.join(start_step)
        if self.pace is not None:
            self.pace.start(step)
        self.data_shift = start_step - step  # from its checkpoint's position (or 0), whatever the federation's step
        if step > 0:  # the schedule follows the federation's step (also drops a restored rewarm factor)
            self.scheduler.last_epoch = step - 1
            self.scheduler.step()
        if self.rewarm and self.fresh_optimizer and step > 0:
            self.rewarm_from = step
            self._rewarm(step)
        return step

    def rewarm_factor(self, step: int) -> float:
        """The factor on the schedule's learning rate of step ``step`` (0-based): ``(step - join + 1) /
        optim.warmup_steps`` for a fresh optimizer that joined at step ``join``, up to 1; else 1."""
        if self.rewarm_from is None:
            return 1.0
        return min(1.0, (step - self.rewarm_from + 1) / self.warmup_steps)

    def _rewarm(self, step: int) -> None:
        """Scale the learning rate the scheduler set for ``step`` (``LambdaLR`` sets it from its
        base each step, so the factor does not compound)."""
        factor = self.rewarm_factor(step)
        if factor < 1.0:
            for group in self.optimizer.param_groups:
                group["lr"] *= factor

    def trained(self, tokens: int) -> None:
        self.federation.trained(tokens)

    def optimizer_step(self) -> None:
        if self.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        self._rewarm(self.scheduler.last_epoch)  # the next step's
        if self.pace is not None:
            self.pace.step_taken()

    def lr(self) -> float:
        return self.step_lr

    def boundary_at(self, done: int) -> bool:
        if self.pace is not None:
            return self.pace.due(done)
        return done > 0 and (done % self.every == 0 or done == self.steps)

    def applies_at(self, done: int) -> bool:
        return self.boundary_at(done)

    def finish_due(self, done: int, index: int) -> list[dict]:
        record = self.federation.round_at(done)
        if self.pace is not None:
            self.pace.round_done(done)
        return [record]

    def ends_at(self, done: int) -> bool:
        """At train.steps; with federation.every_s after the first round in which a facility reached it."""
        if self.pace is not None:
            return done >= self.steps or (self.pace.due(done) and self.federation.ended)
        return done == self.steps

    def arrive(self, done: int) -> None:
        pass  # the round's quorum is where facilities meet

    def job_step(self, done: int) -> int:
        return done

    def end_step(self, done: int, rounds: list[dict], losses, evals: list[dict]) -> None:
        if self.boundary_at(done):
            self.ckpt.after_round(done, rounds, losses, final=self.ends_at(done), records={"evals": evals})

    def starts_at(self, done: int) -> bool:
        return False

    def start_due(self, done: int, index: int) -> None:
        pass

    def finish(self) -> dict:
        federation = self.federation.describe()
        federation["elastic"]["rewarm"] = (
            None if self.rewarm_from is None else {"from_step": self.rewarm_from, "steps": self.warmup_steps}
        )
        return {"strategy": self.strategy, "federation": federation, "checkpoints": self.ckpt.close()}

    def leave(self) -> str:
        """Leave the federation now (at a stop request); the line that says how to rejoin."""
        self.left = True
        self.federation.leave()
        return f"facility {self.name} left the federation at {self.federation.options.elastic.lighthouse}"

    def close(self) -> None:
        self.federation.leave()
