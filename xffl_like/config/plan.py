"""What the launcher planned, handed to every worker: workers never plan (nor check) it again.

:func:`worker_plan` runs in the launching process after :func:`xffl_like.config.validate.validate_config`; the
:class:`WorkerPlan` travels with the validated job to each worker (``train_worker(job, run_dir, started,
plan)``), which builds its :class:`~xffl_like.distributed.state.DistributedState` on ``plan.layout`` and
its federation on ``plan.phases``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..distributed.layout import Layout
from ..federation.options import Phase, plan_phases
from .schema import JobConfig

__all__ = ["WorkerPlan", "worker_plan"]


@dataclass(frozen=True)
class WorkerPlan:
    layout: Layout  # facilities, replicas and shards of the world
    phases: tuple[Phase, ...]  # the federation's phases (one without federation.schedule)
    overlap: bool  # an exchange overlaps local steps in some phase: its groups are built (state.overlap_*)


def worker_plan(job: JobConfig, layout: Layout) -> WorkerPlan:
    """The plan of a validated ``job`` on ``layout`` (pure)."""
    phases = tuple(plan_phases(job.federation, job.train.steps))
    overlap = job.parallel.name == "fsdp" and any(
        phase.config.overlap_steps > 0 or phase.config.delay > 0 for phase in phases
    )
    return WorkerPlan(layout, phases, overlap)
