"""The local optimizer: its typed config, parameter groups and learning-rate schedule.

``OptimConfig.from_mapping`` (:func:`xffl_like.config.schema.job_config`, on the plain ``optim`` dict)
checks every ``optim.*``
value once, in the launching process; workers receive the checked object and call
:func:`build_optimizer` and :func:`build_scheduler`. The schedule is a
``LambdaLR`` whose factor is a small callable object, so ``scheduler.state_dict()`` holds
plain values and a checkpoint can restore it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..config.schema import OPTIMIZERS, SCHEDULES, OptimConfig
from ..models.params import decay_groups

__all__ = [
    "OPTIMIZERS",
    "SCHEDULES",
    "OptimConfig",
    "Schedule",
    "build_optimizer",
    "build_scheduler",
    "decay_groups",
    "schedule_at",
]


def build_optimizer(
    model: nn.Module | Iterable[tuple[str, Tensor]], cfg: OptimConfig, offload: bool = False
) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.name`` over two groups: decayed and not decayed (empty groups are dropped).

    ``model``: a module, or ``(name, parameter)`` pairs (one bucket of DecentralizedDataParallel). ``offload``
    (``parallel.cpu_offload``): the parameters live on the host, and AdamW runs torch's fused CPU kernel."""
    if not isinstance(model, nn.Module):
        model = list(model)
    params = dict(model.named_parameters()) if isinstance(model, nn.Module) else dict(model)
    decay, no_decay = decay_groups(model, cfg.decay_all)
    groups = [
        {"params": [params[n] for n in names], "weight_decay": wd}
        for names, wd in ((decay, cfg.weight_decay), (no_decay, 0.0))
        if names
    ]
    if cfg.name == "adamw":
        from .speed import fused_adamw

        fused = fused_adamw(params.values(), offload) or None  # None: torch's default (foreach), as before
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


@dataclass
class Schedule:
    """Learning-rate factor (of ``optim.lr``) of optimizer step ``s`` (0-based).

    Warm-up: ``(s + 1) / warmup_steps`` while ``s < warmup_steps`` (the first step is never
    taken at lr 0). Then, with ``p = (s - warmup_steps) / max(1, total_steps - warmup_steps - 1)``
    clamped to [0, 1] (0 at the first step after the warm-up, 1 at the last step):
    ``constant`` 1; ``linear`` ``1 - p (1 - r)``; ``cosine`` ``r + (1 - r)(1 + cos(pi p)) / 2``,
    with ``r = min_lr / lr``. A plain object (not a lambda) so that ``LambdaLR.state_dict``
    saves it.
    """

    schedule: str
    warmup_steps: int
    total_steps: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        p = min(1.0, max(0.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps - 1)))
        if self.schedule == "linear":
            return 1.0 - p * (1.0 - self.min_ratio)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over every group of ``optimizer`` following :class:`Schedule`; step it after each
    optimizer step."""
    schedule = Schedule(cfg.schedule, cfg.warmup_steps, total_steps, cfg.min_lr / cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def schedule_at(scheduler: torch.optim.lr_scheduler.LambdaLR, step: int) -> None:
    """Move ``scheduler`` to step ``step`` (0-based: the next optimizer step is step ``step``) and set every
    group's learning rate from it: what ``last_epoch = step - 1; step()`` does, without PyTorch's warning
    about a scheduler stepped before its optimizer (a resumed or joining facility moves it before training)."""
    scheduler.last_epoch = step
    groups = scheduler.optimizer.param_groups
    for group, base, fn in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(step)
    scheduler._last_lr = [group["lr"] for group in groups]
