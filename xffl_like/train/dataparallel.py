"""The ``parallel`` config group: Decent-DP or Bagua data parallelism in the main job.

``parallel=fsdp`` (the default) is the FSDP2/HSDP path with the federation's rounds
(:class:`~.sync.FederatedSync`). ``parallel=decentralized`` and ``parallel=bagua`` keep a full
copy of the model on every rank and let :mod:`xffl_like.parallel` keep the copies in step
(:class:`DataParallelSync`, the same worker loop, :mod:`.loop`): no FSDP, no rounds across
facilities, no checkpoints. The consensus distance (mean distance of the copies to their
average) is logged at every log step: ``consensus_distance`` in ``metrics.jsonl``,
``train/consensus_distance`` on W&B, the history and the last value in ``summary.json``.
After the last step every copy becomes the exact mean of all copies; the final evaluation
and the export see that one model. Facilities still partition the data (non-IID per facility)
and, for Bagua's hierarchical modes and ``alternating-exp-ring``, are the "nodes".

The section's type is :class:`xffl_like.schema.ParallelConfig`; the launcher checks it
(:func:`xffl_like.parallel.options.validate_parallel`) and its relations to the other
sections (:func:`xffl_like.config.validate_config`) before any worker starts;
:class:`DataParallelSync` builds the wrapped model in a worker from the validated section.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel as P
from ..models import build_model
from ..parallel.options import DP_ALGORITHMS
from ..schema import JobConfig
from .optim import Schedule, build_optimizer, build_scheduler
from .round_dump import RoundDump

__all__ = ["DataParallelSync", "Switch"]


@dataclass(frozen=True)
class Switch:
    """After optimizer step ``at_step`` (1-based) the job continues with ``algorithm(**options)``."""

    at_step: int
    algorithm: str
    options: dict = field(default_factory=dict)


class DataParallelSync:
    """The :class:`~.sync.Sync` of ``parallel=decentralized|bagua``: one worker's full copy.

    ``model`` is the plain model (every rank a full copy: evaluate and export it);
    ``module`` (also ``wrapped``) is what the training step calls. ``optimizer``/``scheduler``
    are the job's for Bagua and ``None`` for Decent-DP, whose optimizers (one per bucket) step
    inside the backward pass. Collective: every rank builds it at the same point.
    """

    def __init__(self, cfg: JobConfig, state):
        """Reads ``cfg.parallel`` (the validated section), ``model``, ``optim``, ``seed``, ``train.steps`` and
        ``train.log_every``."""
        self.cfg, ocfg, steps = cfg.parallel, cfg.optim, cfg.train.steps
        model = build_model(cfg.model, device=state.device, seed=cfg.seed)  # the same start on every rank
        if cfg.model.path:
            from ..checkpoint.hf import load_hf_weights

            load_hf_weights(model, cfg.model.path)
        self.state, self.model, self.ocfg, self.steps, self.log_every = state, model, ocfg, steps, cfg.train.log_every
        self.consensus: list[dict] = []
        self.ckpt = None  # no checkpoints (refused by the launcher's checks)
        self.data_seed = cfg.seed
        self.dump = RoundDump(model, state)  # tests only ($XFFL_TEST_DUMP_ROUNDS): the copies around switches, the end
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.switches: list[dict] = []
        node = state.facility_size  # "node" = facility in the main job (sizes may differ)
        if self.cfg.name == "decentralized":
            self.wrapped = P.DecentralizedDataParallel(
                model,
                self._optim_fn(),
                partial(build_scheduler, cfg=ocfg, total_steps=steps),
                topology=self.cfg.topology,
                grad_clip_norm=ocfg.grad_clip,
                bucket_size_in_mb=float(self.cfg.bucket_mb),
                local_world_size=node,
            )
        else:
            self.optimizer = build_optimizer(model, ocfg)
            self.scheduler = build_scheduler(self.optimizer, ocfg, steps)
            algorithm = DP_ALGORITHMS[self.cfg.algorithm](**(self.cfg.options or {}))
            self.wrapped = P.with_algorithm(
                model, self.optimizer, algorithm, bucket_mb=float(self.cfg.bucket_mb), local_world_size=node
            )
        self._next = {at: Switch(at, name, options) for at, name, options in self.cfg.algorithms()[1:]}
        self.module = self.wrapped

    def _optim_fn(self) -> Callable:
        o, name = self.ocfg, self.cfg.optimizer
        if name == "optim":
            return partial(build_optimizer, cfg=o)  # the optim group over one bucket's (name, parameter) pairs
        factory = {
            "adam": P.optim_fn_adam,
            "adamw": P.optim_fn_adamw,
            "accum_adam": P.optim_fn_accum_adam,
            "accum_adamw": P.optim_fn_accum_adamw,
        }[name]
        extra = {"accum_iter": self.cfg.accum_iter} if name.startswith("accum_") else {}
        return partial(
            factory,
            lr=o.lr,
            beta1=o.betas[0],
            beta2=o.betas[1],
            eps=o.eps,
            weight_decay=o.weight_decay,
            decay_all=o.decay_all,
            **extra,
        )

    # ------------------------------------------------------------------ the loop's calls (Sync)
    def restore(self, losses: torch.Tensor) -> None:
        return None  # no checkpoints (refused by the launcher's checks)

    def begin(self, start_step: int, rounds: int) -> int:
        return start_step

    def close(self) -> None:
        pass

    def trained(self, tokens: int) -> None:
        pass

    paced = False  # every copy steps in lockstep
    data_facility = None  # the layout's facility index and count

    def arrive(self, done: int) -> None:
        pass

    def ends_at(self, done: int) -> bool:
        return done == self.steps

    def job_step(self, done: int) -> int:
        return done

    def boundary_at(self, done: int) -> bool:
        return done == self.steps  # no rounds: the local model is evaluated at the end (and every eval_every)

    def applies_at(self, done: int) -> bool:
        return False

    def finish_due(self, done: int, index: int) -> list[dict]:
        return []

    def metrics(self, done: int) -> dict:
        """The consensus distance at every log step and the last (collective there)."""
        if done % self.log_every and done != self.steps:
            return {}
        distance = self.consensus_distance()
        self.consensus.append({"step": done, "distance": distance})
        return {"consensus": distance}

    def end_step(self, done: int, rounds: list[dict], losses: torch.Tensor, evals: list[dict]) -> None:
        pass

    def starts_at(self, done: int) -> bool:
        return self.switch_due(done) is not None

    def start_due(self, done: int, index: int) -> None:
        self.dump.save(len(self.switches), "before")
        self.switch(self.switch_due(done))
        self.dump.save(len(self.switches) - 1, "after")

    def optimizer_step(self) -> None:
        self.step()

    def step(self) -> None:
        """After the step's backward passes: Bagua's optimizer step (Decent-DP stepped inside backward)."""
        if self.optimizer is None:
            return
        if self.ocfg.grad_clip > 0:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.ocfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def lr(self) -> float:
        """The learning rate of the step just taken."""
        if self.optimizer is not None:
            return self.optimizer.param_groups[0]["lr"]
        optimizers = self.wrapped.optimizers  # empty until Decent-DP's second iteration
        if optimizers:
            return optimizers[0].param_groups[0]["lr"]
        o = self.ocfg  # step 1's update waits for step 2's forward: the rate it will use
        return o.lr * Schedule(o.schedule, o.warmup_steps, self.steps, o.min_lr / o.lr)(0)

    def switch_due(self, done: int) -> Switch | None:
        """The switch to make after optimizer step ``done`` (1-based), if any."""
        return self._next.get(done)

    def switch(self, sw: Switch) -> None:
        """Bagua's ``switch_to`` (collective): every copy continues from the mean weights and optimizer state."""
        self.wrapped.switch_to(DP_ALGORITHMS[sw.algorithm](**sw.options))
        self.switches.append({"step": sw.at_step, "algorithm": sw.algorithm, "options": sw.options})

    def consensus_distance(self) -> float:
        """Mean distance of the copies to their average (collective)."""
        return P.consensus_distance(self.model)

    def finish(self) -> dict:
        """End of training: every copy the exact mean of all (collective); what the summary adds."""
        self.dump.save(len(self.switches), "before")  # the copies as trained, before the final mean
        self.average()
        return {
            "extra": {
                "parallel": self.describe(),
                "consensus_distance": self.consensus,
                "final_consensus_distance": self.consensus[-1]["distance"] if self.consensus else 0.0,
            }
        }

    @torch.no_grad()
    def average(self) -> None:
        """Stop the algorithm and make every copy the exact mean (collective)."""
        if self.optimizer is None:
            self.wrapped.global_avg()
        else:
            self.wrapped.algorithm.detach()  # finishes exchanges, stops AsyncModelAverage's thread
            P.allreduce_parameters(self.model)
        dist.barrier()

    def describe(self) -> dict:
        """What the summary reports under ``parallel``."""
        c = self.cfg
        if c.name == "decentralized":
            return {
                "name": c.name,
                "topology": c.topology,
                "optimizer": c.optimizer,
                "bucket_mb": float(c.bucket_mb),
                "buckets": len(self.wrapped.optimizers),
            }
        return {
            "name": c.name,
            "algorithm": c.algorithm,
            "options": dict(c.options or {}),
            "bucket_mb": float(c.bucket_mb),
            "switches": self.switches,
        }
