"""``federation.elastic.hub``: this job is one facility of a federation of independent jobs.

:class:`ElasticSync` composes the facility's :class:`~.sync.ShardedParts` (FSDP2/HSDP inside the
facility, the inner optimizer and its schedule) with
:class:`~xffl_like.federation.elastic.exchange.ElasticFederation`'s rounds: among the facilities
arriving at each boundary, held by the hub. Before the first step the facility joins: it
downloads θ_global from the hub and adopts the federation's step (its data position and inner optimizer
stay its own: from its checkpoint, or fresh). A facility whose step is not the federation's at a round (it
missed rounds, or trained through them) realigns the same way there: the round's record carries the new step.
A joiner whose inner optimizer is fresh (no checkpoint
of its own) warms its learning rate up again from its join step (``federation.elastic.rewarm``), as
any fresh optimizer does at step 0.

Data: every facility is facility 0 of its own world, so its identity in the data is its name's
(:func:`data_identity`): a synthetic source keeps the job's seed (its shared chain is the
federation's, as ``data.non_iid`` says) and takes a number from the name as its facility (its own
chain and batches); a corpus is read whole by every facility, its windows drawn with the job's seed
plus that number.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from ..checkpoint.store import checkpoint_dir
from ..config.schema import JobConfig
from ..distributed.state import DistributedState
from ..federation.elastic import facility_name
from ..federation.elastic.delayed import delayed_elastic
from ..federation.elastic.exchange import ElasticFederation
from ..federation.protocol import Boundary
from ..hub.client import hub_link
from ..observe.timing import PhaseTimer
from .nonfinite import NonFiniteGuard
from .optim import schedule_at
from .sync import Capabilities, ShardedParts, StepEnd, SyncBase

__all__ = ["ElasticSync", "data_identity"]


def data_identity(cfg: JobConfig) -> tuple[int, int, int]:
    """(seed, facility, facilities) of this facility's batches (see the module docstring)."""
    identity = zlib.crc32(facility_name(cfg.federation.elastic).encode()) % (1 << 31)
    if cfg.data.name == "synthetic":
        return cfg.seed, identity, 1 << 31
    return cfg.seed + identity, 0, 1


class ElasticSync(SyncBase):
    """Rounds among the facilities present; joins at the start, leaves at a stop and when closed."""

    def __init__(self, parts: ShardedParts, federation, timer: PhaseTimer, *, rewarm: int, strategy: dict, guard=None):
        """``federation``: this facility's :class:`~xffl_like.federation.elastic.exchange.ElasticFederation`;
        ``rewarm``: the warm-up steps of a fresh optimizer that joins late (0: none); ``guard``: the
        :class:`~.nonfinite.NonFiniteGuard` of ``federation.on_nonfinite``, checked before each round."""
        self.parts, self.module, self.federation, self.timer = parts, parts.model, federation, timer
        self.guard = guard
        self.name, self.clock, self.strategy = federation.name, federation.clock, strategy
        # federation.every_s: a round's quorum may end the job (a facility reached train.steps)
        self.rounds_end_job = federation.options.every_s is not None
        # This world is one facility: its ranks step together, stop at any step, and it leaves at a stop.
        self.capabilities = Capabilities(checkpoints=True, elastic=True)
        self.warmup_steps = rewarm
        self.fresh_optimizer = True  # no checkpoint restored
        self.rewarm_from: int | None = None  # the join step a fresh optimizer warms up again from

    @classmethod
    def build(
        cls, cfg: JobConfig, state: DistributedState, parts: ShardedParts, run_dir, steps: int, timer: PhaseTimer
    ):
        """The job's: this facility joins the federation of ``federation.elastic`` (collective)."""
        name = facility_name(cfg.federation.elastic)
        link = hub_link(cfg, name, state.world_size) if cfg.federation.elastic.hub and state.rank == 0 else None
        spool = Path(run_dir) / ".hub-spool"
        kind = ElasticFederation if not cfg.federation.delay else delayed_elastic(cfg.federation)
        federation = kind(cfg.federation, parts.model, state, name, steps, link=link, spool=spool)
        rewarm = cfg.optim.warmup_steps if cfg.federation.elastic.rewarm else 0
        described = {"name": cfg.strategy.name, "streams": cfg.strategy.streams}
        where = checkpoint_dir(cfg.checkpoint, run_dir)
        guard = NonFiniteGuard(cfg.federation.on_nonfinite, state, parts.model, parts.optimizer, where)
        return cls(parts, federation, timer, rewarm=rewarm, strategy=described, guard=guard)

    def begin(self, done: int) -> int:
        with self.timer("aggregation"):  # the join: the federation's waits and θ_global's download
            step = self.federation.join(done)
        if step > 0:  # the schedule follows the federation's step (also drops a restored rewarm factor)
            schedule_at(self.parts.scheduler, step)
        if self.warmup_steps > 0 and self.fresh_optimizer and step > 0:
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
            for group in self.parts.optimizer.param_groups:
                group["lr"] *= factor

    def optimizer_step(self, tokens: int) -> float:
        self.federation.trained(tokens)
        lr = self.parts.lr()  # the rate of the step taken now
        self.federation.after_backward()
        self.parts.step()
        self._rewarm(self.parts.scheduler.last_epoch)  # the next step's
        return lr

    def finish(self, boundary: Boundary, index: int) -> StepEnd:
        done = boundary.step
        if not boundary.finish:
            return StepEnd(done)
        if self.guard is not None:  # fail: stop with one line; skip: the hub rejects it, and it heals
            self.guard.check_own(index, done)
        with self.timer("aggregation"):  # the round's quorum is where facilities meet: its wait is in the round
            records = self.federation.finish(boundary, index)
            self.clock.round_done(done)
        step = records[-1].step if records else done
        if step != done:  # realigned to the federation's step (it missed rounds, or trained through them)
            self._realign(done, step)
        return StepEnd(step, records, ended=self.rounds_end_job and self.federation.ended)

    def start(self, boundary: Boundary, index: int) -> None:
        # federation.delay=1: the round's exchange starts after the boundary's checkpoint, in the leader's thread
        if boundary.start:
            with self.timer("aggregation"):
                self.federation.start(boundary, index)

    def _realign(self, done: int, step: int) -> None:
        """The schedule follows the federation's step ``step`` (not this facility's ``done``), and a re-warm-up
        counts the steps trained since the join, as before."""
        schedule_at(self.parts.scheduler, step)
        if self.rewarm_from is not None:
            self.rewarm_from += step - done
            self._rewarm(step)

    def state_dict(self, at_step: int | None = None) -> dict:
        return self.federation.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.federation.load_state_dict(sd)
        self.fresh_optimizer = False

    def leave(self) -> str:
        """Leave the federation now (at a stop request); the line that says how to rejoin."""
        self.federation.leave()
        e = self.federation.options.elastic
        return f"facility {self.name} left the federation at the hub {e.hub}"

    def close(self) -> dict:
        self.federation.leave()
        federation = self.federation.describe()
        rewarm = None if self.rewarm_from is None else {"from_step": self.rewarm_from, "steps": self.warmup_steps}
        federation["elastic"]["rewarm"] = rewarm
        return {"strategy": self.strategy, "federation": federation}
