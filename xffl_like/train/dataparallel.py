"""The ``parallel`` config group: Decent-DP or Bagua data parallelism in the main job.

``parallel=fsdp`` (the default) is the FSDP2/HSDP path with the federation's rounds
(:class:`~.sync.FederatedSync`). ``parallel=decentralized`` and ``parallel=bagua`` keep a full
copy of the model on every rank and let :mod:`xffl_like.parallel` keep the copies in step
(:class:`DataParallelSync`, the same :class:`~.trainer.Trainer`): no FSDP, no rounds across
facilities, no checkpoints. The consensus distance (mean distance of the copies to their
average) is logged at every log step: ``consensus_distance`` in ``metrics.jsonl``,
``train/consensus_distance`` on W&B, the history and the last value in ``summary.json``.
After the last step every copy becomes the exact mean of all copies; the final evaluation
and the export see that one model. Facilities still partition the data (non-IID per facility)
and, for Bagua's hierarchical modes and ``alternating-exp-ring``, are the "nodes".

The section's type is :class:`xffl_like.config.schema.ParallelConfig`; the launcher checks it
(:func:`xffl_like.parallel.options.validate_parallel`) and its relations to the other
sections (:func:`xffl_like.config.validate.validate_config`) before any worker starts;
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
from ..config.schema import JobConfig
from ..federation.protocol import Boundary
from ..models import build_model
from ..observe.timing import PhaseTimer
from ..parallel.options import DP_ALGORITHMS
from .observers import round_observers
from .optim import Schedule, build_optimizer, build_scheduler
from .sync import SyncBase, TrainerHooks

__all__ = ["DataParallelSync", "Switch", "build_full_model"]


def build_full_model(cfg: JobConfig, state) -> nn.Module:
    """A full copy of the model on this rank, the same start on every rank (``model.path``: Hugging Face weights)."""
    model = build_model(cfg.model, device=state.device, seed=cfg.seed)
    if cfg.model.path:
        from ..checkpoint.hf import load_hf_weights

        load_hf_weights(model, cfg.model.path)
    return model


@dataclass(frozen=True)
class Switch:
    """After optimizer step ``at_step`` (1-based) the job continues with ``algorithm(**options)``."""

    at_step: int
    algorithm: str
    options: dict = field(default_factory=dict)


class DataParallelSync(SyncBase):
    """The :class:`~.sync.Sync` of ``parallel=decentralized|bagua``: one worker's full copy.

    ``model`` is the plain model (every rank a full copy: evaluate and export it);
    ``module`` (also ``wrapped``) is what the training step calls. ``optimizer``/``scheduler``
    are the job's for Bagua and ``None`` for Decent-DP, whose optimizers (one per bucket) step
    inside the backward pass. No checkpoints (refused by the launcher's checks). Collective:
    every rank builds it at the same point.
    """

    def __init__(self, cfg: JobConfig, state, model: nn.Module, timer: PhaseTimer):
        """Reads ``cfg.parallel`` (the validated section), ``optim``, ``train.steps`` and ``train.log_every``;
        ``model``: the same start on every rank."""
        self.cfg, ocfg, steps = cfg.parallel, cfg.optim, cfg.train.steps
        self.state, self.model, self.ocfg, self.steps, self.log_every = state, model, ocfg, steps, cfg.train.log_every
        self.timer = timer
        self.consensus: list[dict] = []
        self.hooks = TrainerHooks(None, round_observers(model, state))  # tests: the copies around switches, the end
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

    # ------------------------------------------------------------------ the trainer's calls (Sync)
    def metrics(self, done: int) -> dict:
        """The consensus distance at every log step and the last (collective there)."""
        if done % self.log_every and done != self.steps:
            return {}
        with self.timer("eval"):  # a measurement of the copies, as an evaluation is
            distance = self.consensus_distance()
        self.consensus.append({"step": done, "distance": distance})
        return {"consensus": distance}

    def start(self, boundary: Boundary, index: int) -> None:
        """An algorithm switch after the boundary's step; after the last step every copy becomes the mean of all."""
        done = boundary.step
        switch = self.switch_due(done)
        if switch is not None and done < self.steps:
            with self.timer("aggregation"):
                self.hooks.save(len(self.switches), "before")
                self.switch(switch)
                self.hooks.save(len(self.switches) - 1, "after")
        if done == self.steps:
            self.hooks.save(len(self.switches), "before")  # the copies as trained, before the final mean
            with self.timer("aggregation"):
                self.average()

    def optimizer_step(self, tokens: int) -> float:
        """After the step's backward passes: Bagua's optimizer step (Decent-DP stepped inside backward);
        the learning rate of the step just taken."""
        if self.optimizer is not None:
            if self.ocfg.grad_clip > 0:
                nn.utils.clip_grad_norm_(self.model.parameters(), self.ocfg.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
        return self.lr()

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

    def close(self) -> dict:
        """What the summary adds (the copies were averaged after the last step)."""
        last = self.consensus[-1]["distance"] if self.consensus else 0.0
        return {
            "extra": {
                "parallel": self.describe(),
                "consensus_distance": self.consensus,
                "final_consensus_distance": last,
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
