"""The local optimizer: its typed config, parameter groups and learning-rate schedule.

``OptimConfig.from_mapping(cfg["optim"])`` (:mod:`xffl_like.schema`) checks every ``optim.*``
value once, in the launching process; workers receive the checked object and call
:func:`build_optimizer` and :func:`build_scheduler`. The schedule is a
``LambdaLR`` whose factor is a small callable object, so ``scheduler.state_dict()`` holds
plain values and a checkpoint can restore it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ..schema import OPTIMIZERS, SCHEDULES, OptimConfig

__all__ = ["OPTIMIZERS", "SCHEDULES", "OptimConfig", "Schedule", "build_optimizer", "build_scheduler",
           "decay_groups"]


def decay_groups(model: nn.Module, decay_all: bool = False) -> tuple[list[str], list[str]]:
    """Names of the parameters that get weight decay, and of those that do not.

    Without ``decay_all``, norms (modules whose class name ends in ``Norm``), biases and
    embeddings (``nn.Embedding``, hence also a head tied to it) are not decayed: shrinking a
    norm's gain or a rare token's row towards zero is not regularisation. Each shared
    parameter is listed once, under its first name.
    """
    exempt: set[int] = set()
    if not decay_all:
        for module in model.modules():
            is_norm = type(module).__name__.endswith("Norm") or isinstance(module, (nn.LayerNorm, nn.GroupNorm))
            for pname, param in module.named_parameters(recurse=False):
                if is_norm or isinstance(module, nn.Embedding) or pname == "bias":
                    exempt.add(id(param))
    decay, no_decay, seen = [], [], set()
    for name, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if id(param) in exempt else decay).append(name)
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.name`` over two groups: decayed and not decayed (empty groups are dropped)."""
    params = dict(model.named_parameters())
    decay, no_decay = decay_groups(model, cfg.decay_all)
    groups = [{"params": [params[n] for n in names], "weight_decay": wd}
              for names, wd in ((decay, cfg.weight_decay), (no_decay, 0.0)) if names]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)
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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` over every group of ``optimizer`` following :class:`Schedule`; step it after each optimizer step."""
    schedule = Schedule(cfg.schedule, cfg.warmup_steps, total_steps, cfg.min_lr / cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
