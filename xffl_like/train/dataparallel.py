"""The ``parallel`` config group: Decent-DP or Bagua data parallelism in the main job.

``parallel=fsdp`` (the default) is the FSDP2/HSDP path with the federation's rounds
(:mod:`.loop`). ``parallel=decentralized`` and ``parallel=bagua`` keep a full copy of the
model on every rank and let :mod:`xffl_like.parallel` keep the copies in step: no FSDP,
no rounds across facilities. Facilities still partition the data (non-IID per facility)
and, for Bagua's hierarchical modes and ``alternating-exp-ring``, are the "nodes".

:class:`ParallelOptions` checks the group's keys; :func:`validate_parallel` refuses the
combinations with other groups that make no sense (one line each), in the launching
process; :class:`DataParallel` builds the wrapped model in a worker.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from .. import parallel as P
from .optim import OptimConfig, Schedule, build_optimizer, build_scheduler
from ..checks import is_int, is_number

__all__ = ["ALGORITHMS", "DataParallel", "MODES", "OPTIMIZERS", "ParallelOptions", "parallel_mode",
           "validate_parallel"]

MODES = ("fsdp", "decentralized", "bagua")
OPTIMIZERS = ("optim", "adam", "adamw", "accum_adam", "accum_adamw")
ALGORITHMS: dict[str, type[P.Algorithm]] = {
    "gradient_allreduce": P.GradientAllReduce,
    "bytegrad": P.ByteGrad,
    "decentralized": P.Decentralized,
    "low_precision_decentralized": P.LowPrecisionDecentralized,
    "async_model_average": P.AsyncModelAverage,
}
# The values of conf/parallel/fsdp.yaml: keys of the other modes keep them where they do not apply.
DEFAULTS = {"topology": "ring", "optimizer": "optim", "accum_iter": 4, "bucket_mb": 25,
            "algorithm": "gradient_allreduce", "options": None, "switch": []}
_OWNER = {"topology": "decentralized", "optimizer": "decentralized", "accum_iter": "decentralized",
          "bucket_mb": "decentralized or parallel=bagua", "algorithm": "bagua", "options": "bagua", "switch": "bagua"}


def parallel_mode(cfg: Mapping[str, Any]) -> str:
    """``cfg["parallel"]["name"]``; ``fsdp`` when the group is absent."""
    return (cfg.get("parallel") or {}).get("name", "fsdp")


@dataclass(frozen=True)
class Switch:
    """After optimizer step ``at_step`` (1-based) the job continues with ``algorithm(**options)``."""

    at_step: int
    algorithm: str
    options: dict = field(default_factory=dict)


def _algorithm(name: Any, options: Any, where: str) -> P.Algorithm:
    if name not in ALGORITHMS:
        raise ValueError(f"{where}algorithm={name!r}: use one of {', '.join(ALGORITHMS)}")
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}options={options!r}: must be a mapping of {name}'s keyword arguments, e.g. "
                         f"{{hierarchical: true}}")
    try:
        return ALGORITHMS[name](**options)
    except TypeError as exc:
        takes = ", ".join(list(inspect.signature(ALGORITHMS[name]).parameters))
        raise ValueError(f"{where}options={dict(options)!r}: {name} takes {takes}") from None
    except ValueError as exc:
        raise ValueError(f"{where}options={dict(options)!r}: {exc}") from None


@dataclass(frozen=True)
class ParallelOptions:
    """``conf/parallel/*.yaml``, checked."""

    name: str
    topology: str = "ring"
    optimizer: str = "optim"
    accum_iter: int = 4
    bucket_mb: float = 25
    algorithm: str = "gradient_allreduce"
    options: dict = field(default_factory=dict)
    switch: tuple[Switch, ...] = ()

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "ParallelOptions":
        """Build from ``cfg["parallel"]``; one-line ``ValueError`` naming the key and the fix."""
        name = m.get("name", "fsdp")
        if name not in MODES:
            raise ValueError(f"parallel.name={name!r}: use parallel=fsdp, parallel=decentralized or parallel=bagua")
        used = {"fsdp": (), "decentralized": ("topology", "optimizer", "accum_iter", "bucket_mb"),
                "bagua": ("bucket_mb", "algorithm", "options", "switch")}[name]
        for key, default in DEFAULTS.items():
            if key not in used and m.get(key, default) != default:
                raise ValueError(f"parallel.{key}={m.get(key)!r} applies to parallel={_OWNER[key]}, not parallel={name}: "
                                 f"drop it or select that mode")
        topology = m.get("topology", "ring")
        if topology not in P.TOPOLOGIES:
            raise ValueError(f"parallel.topology={topology!r}: use one of {', '.join(P.TOPOLOGIES)}")
        optimizer = m.get("optimizer", "optim")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"parallel.optimizer={optimizer!r}: use one of {', '.join(OPTIMIZERS)}")
        accum = m.get("accum_iter", 4)
        if not is_int(accum) or accum < 1:
            raise ValueError(f"parallel.accum_iter={accum!r}: must be an integer >= 1 (e.g. parallel.accum_iter=4)")
        bucket = m.get("bucket_mb", 25)
        if not is_number(bucket) or not bucket > 0:
            raise ValueError(f"parallel.bucket_mb={bucket!r}: must be a positive number of MiB (e.g. parallel.bucket_mb=25)")
        options = m.get("options") or {}
        _algorithm(m.get("algorithm", "gradient_allreduce"), options, "parallel.")
        raw = m.get("switch") or []
        if not isinstance(raw, (list, tuple)):
            raise ValueError(f"parallel.switch={raw!r}: must be a list such as [{{at_step: 20, algorithm: decentralized}}]")
        switches, last = [], 0
        for i, entry in enumerate(raw):
            where = f"parallel.switch[{i}]."
            if not isinstance(entry, Mapping) or set(entry) - {"at_step", "algorithm", "options"}:
                raise ValueError(f"parallel.switch[{i}]={entry!r}: each entry has at_step, algorithm and optional options")
            at = entry.get("at_step")
            if not is_int(at) or at <= last:
                raise ValueError(f"{where}at_step={at!r}: must be an integer > {last} (steps are 1-based and increasing)")
            _algorithm(entry.get("algorithm"), entry.get("options") or {}, where)
            switches.append(Switch(at, entry["algorithm"], dict(entry.get("options") or {})))
            last = at
        return cls(name, topology, optimizer, accum, float(bucket), m.get("algorithm", "gradient_allreduce"),
                   dict(options), tuple(switches))

    def algorithms(self) -> list[tuple[int, str, dict]]:
        """(first step, name, options) of every phase of a Bagua run, the initial one at step 0."""
        return [(0, self.algorithm, self.options)] + [(s.at_step, s.algorithm, s.options) for s in self.switch]


def validate_parallel(cfg: dict, world_size: int) -> ParallelOptions:
    """Check ``parallel`` and its relations to the other groups (launching process, before
    :func:`~xffl_like.distributed.layout.plan_layout`). For decentralized/bagua it sets
    ``distributed.hsdp=1`` in place: every rank holds a full copy (a shard group of one)."""
    pcfg = ParallelOptions.from_mapping(cfg.get("parallel") or {})
    mode = pcfg.name
    if mode == "fsdp":
        return pcfg
    dcfg, tcfg, fed = cfg["distributed"], cfg["train"], cfg["federation"]
    if dcfg.get("hsdp") not in (None, 1):
        raise ValueError(f"distributed.hsdp={dcfg['hsdp']!r} shards the model, but parallel={mode} keeps a full copy on "
                         f"every rank: drop distributed.hsdp (null) or use parallel=fsdp")
    dcfg["hsdp"] = 1
    defaults = {"algorithm": "federated", "topology": "complete", "compression": "none", "weights": "uniform",
                "error_feedback": False, "on_nonfinite": "fail"}
    for key, default in defaults.items():
        if fed.get(key, default) != default:
            raise ValueError(f"federation.{key}={fed.get(key)!r} does not apply to parallel={mode} (the copies are kept in "
                             f"step by the {mode} algorithm, no federation rounds): drop it or use parallel=fsdp")
    outer = fed.get("outer") or {}
    if outer.get("name", "average") != "average" or outer.get("lr", 1.0) != 1.0:
        raise ValueError(f"federation.outer (name={outer.get('name')!r}, lr={outer.get('lr')!r}) does not apply to "
                         f"parallel={mode} (no federation rounds): use federation=default or parallel=fsdp")
    # Checkpoints would need every rank's own copy (DCP keeps one copy of replicated tensors).
    if cfg.get("resume") is not None:
        raise ValueError(f"resume={cfg['resume']!r}: parallel={mode} writes no checkpoints and cannot resume; "
                         f"use parallel=fsdp to resume")
    if cfg["checkpoint"].get("dir") is not None:
        raise ValueError(f"checkpoint.dir={cfg['checkpoint']['dir']!r}: parallel={mode} writes no checkpoints; drop it")
    if dcfg.get("max_restarts", 0):
        raise ValueError(f"distributed.max_restarts={dcfg['max_restarts']}: restarts resume from a checkpoint, and "
                         f"parallel={mode} writes none; use 0")
    if (cfg.get("fault") or {}).get("nan_rank") is not None:
        raise ValueError(f"fault.nan_rank: the non-finite guard protects federation rounds, which parallel={mode} "
                         f"does not have; drop it")
    from ..distributed.layout import plan_layout

    facilities = plan_layout(world_size, dcfg.get("federated"), 1).facility_sizes  # an impossible layout: its line
    if mode == "decentralized":
        if tcfg.get("steps") == 1:
            raise ValueError("train.steps=1: parallel=decentralized applies a step's update in the next step's backward "
                             "pass (Decent-DP), so one step never updates; use train.steps >= 2")
        if pcfg.topology == "alternating-exp-ring" and len(set(facilities)) > 1:
            raise ValueError(f"parallel.topology=alternating-exp-ring needs facilities (its nodes) of equal size, got "
                             f"{list(facilities)}: use equal distributed.federated or another topology")
        try:
            P.topology_edges(pcfg.topology, world_size, facilities[0])
        except ValueError as exc:  # impossible sizes: the topology's own line, with the key
            raise ValueError(f"parallel.topology={pcfg.topology}: {exc}") from None
        if pcfg.optimizer.startswith("accum_") or pcfg.optimizer in ("adam", "adamw"):
            if cfg["optim"].get("name") != "adamw":
                raise ValueError(f"parallel.optimizer={pcfg.optimizer} takes lr, betas, eps and weight_decay from "
                                 f"optim=adamw, got optim={cfg['optim'].get('name')}: select optim=adamw")
    else:
        if tcfg.get("grad_accum", 1) != 1:
            raise ValueError(f"train.grad_accum={tcfg['grad_accum']}: parallel=bagua synchronises every backward pass "
                             f"(Bagua has no gradient accumulation); use train.grad_accum=1")
        for at, name, options in pcfg.algorithms():
            where = "parallel." if at == 0 else f"parallel.switch (at_step={at}): "
            if at >= tcfg.get("steps", 0) and at > 0:
                raise ValueError(f"{where}at_step={at} is not before the last step (train.steps={tcfg['steps']}): "
                                 f"switch earlier or drop it")
            algo = ALGORITHMS[name](**options)
            members = len(facilities) if algo.hierarchical else world_size
            if name == "decentralized" and algo.peer_selection_mode == "shift_one" and members > 1 and members % 2:
                what = "facilities (hierarchical: the nodes)" if algo.hierarchical else "processes"
                raise ValueError(f"{where}decentralized with peer_selection_mode=shift_one needs an even number of "
                                 f"{what}, got {members}: use peer_selection_mode=all or change the layout")
    return pcfg


class DataParallel:
    """The wrapped model of one worker for ``parallel=decentralized|bagua``.

    ``model`` is the plain model (every rank a full copy: evaluate and export it);
    ``wrapped`` is what the training step calls. ``optimizer``/``scheduler`` are the
    job's for Bagua and ``None`` for Decent-DP, whose optimizers (one per bucket) step
    inside the backward pass.
    """

    def __init__(self, cfg: dict, state, model: nn.Module, ocfg: OptimConfig, steps: int):
        self.cfg = ParallelOptions.from_mapping(cfg["parallel"])
        self.state, self.model, self.ocfg, self.steps = state, model, ocfg, steps
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.switches: list[dict] = []
        node = state.facility_size  # "node" = facility in the main job (sizes may differ)
        if self.cfg.name == "decentralized":
            self.wrapped = P.DecentralizedDataParallel(
                model, self._optim_fn(), partial(build_scheduler, cfg=ocfg, total_steps=steps),
                topology=self.cfg.topology, grad_clip_norm=ocfg.grad_clip, bucket_size_in_mb=self.cfg.bucket_mb,
                local_world_size=node)
        else:
            self.optimizer = build_optimizer(model, ocfg)
            self.scheduler = build_scheduler(self.optimizer, ocfg, steps)
            self.wrapped = P.with_algorithm(model, self.optimizer, ALGORITHMS[self.cfg.algorithm](**self.cfg.options),
                                            bucket_mb=self.cfg.bucket_mb, local_world_size=node)
        self._next = {s.at_step: s for s in self.cfg.switch}

    def _optim_fn(self) -> Callable:
        o, name = self.ocfg, self.cfg.optimizer
        if name == "optim":
            return partial(build_optimizer, cfg=o)  # the optim group over one bucket's (name, parameter) pairs
        factory = {"adam": P.optim_fn_adam, "adamw": P.optim_fn_adamw, "accum_adam": P.optim_fn_accum_adam,
                   "accum_adamw": P.optim_fn_accum_adamw}[name]
        extra = {"accum_iter": self.cfg.accum_iter} if name.startswith("accum_") else {}
        return partial(factory, lr=o.lr, beta1=o.betas[0], beta2=o.betas[1], eps=o.eps, weight_decay=o.weight_decay,
                       decay_all=o.decay_all, **extra)

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
        self.wrapped.switch_to(ALGORITHMS[sw.algorithm](**sw.options))
        self.switches.append({"step": sw.at_step, "algorithm": sw.algorithm, "options": sw.options})

    def consensus_distance(self) -> float:
        """Mean distance of the copies to their average (collective)."""
        return P.consensus_distance(self.model)

    @torch.no_grad()
    def finish(self) -> None:
        """End of training: stop the algorithm and make every copy the exact mean (collective)."""
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
            return {"name": c.name, "topology": c.topology, "optimizer": c.optimizer, "bucket_mb": c.bucket_mb,
                    "buckets": len(self.wrapped.optimizers)}
        return {"name": c.name, "algorithm": c.algorithm, "options": c.options, "bucket_mb": c.bucket_mb,
                "switches": self.switches}
