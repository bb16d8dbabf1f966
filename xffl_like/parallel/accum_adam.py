"""Optimizers and factories for :class:`DecentralizedDataParallel` (Decent-DP's set).

``AccumAdam``/``AccumAdamW`` step every iteration with the current gradient but
move Adam's moments only every ``accum_iter`` iterations, with the mean gradient
of those iterations. With ``m``, ``v`` the stored moments (kept pre-multiplied by
beta, as in Decent-DP), ``a`` the running mean and ``k = ceil(step / accum_iter)``:

    a    += g / accum_iter
    m_t   = m + (1 - b1) g,   v_t = v + (1 - b2) g^2            (preview with g)
    p    -= lr / (1 - b1^k) * m_t / (sqrt(v_t) / sqrt(1 - b2^k) + eps)
    every accum_iter steps:  m = b1 (m + (1 - b1) a),  v = b2 (v + (1 - b2) a^2),  a = 0

``AccumAdam`` adds ``weight_decay * p`` to the gradient (L2); ``AccumAdamW`` decays
the weights, ``p *= 1 - lr * weight_decay``, before the step. Unlike Decent-DP,
the L2 term is added out of place, so ``p.grad`` is left untouched.

The factories take ``[(name, parameter), ...]`` (what DecentralizedDataParallel
passes, one call per bucket) and split them with the project's one weight-decay rule,
:func:`xffl_like.models.params.decay_groups` (the main job's ``optim.decay_all``):
biases, norm gains and embedding tables get none unless ``decay_all=True``.
Decent-DP's factories did the reverse (decay on names containing "bn" or
"bias" only, so every weight matrix went undecayed), a defect fixed here.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

__all__ = [
    "AccumAdam",
    "AccumAdamW",
    "optim_fn_adam",
    "optim_fn_adamw",
    "optim_fn_accum_adam",
    "optim_fn_accum_adamw",
    "lr_scheduler_fn_cosine_with_warmup",
    "param_groups",
]


class _AccumAdamBase(Optimizer):
    decoupled = False

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_iter: int = 4,
    ):
        if accum_iter < 1:
            raise ValueError(f"accum_iter must be >= 1, got {accum_iter}")
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"invalid hyper-parameters: lr={lr}, betas={betas}, eps={eps}, weight_decay={weight_decay}"
            )
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, accum_iter=accum_iter))

    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            b1, b2 = group["betas"]
            lr, wd, eps, accum = group["lr"], group["weight_decay"], group["eps"], group["accum_iter"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0, dtype=torch.int64)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["accum_grad"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            for s in states:
                s["step"] += 1
            step = int(states[0]["step"])
            grads = [p.grad for p in params]
            if wd != 0 and self.decoupled:
                torch._foreach_mul_(params, 1 - lr * wd)
            elif wd != 0:
                grads = torch._foreach_add(grads, params, alpha=wd)
            m, v, a = ([s[k] for s in states] for k in ("exp_avg", "exp_avg_sq", "accum_grad"))
            torch._foreach_add_(a, grads, alpha=1.0 / accum)
            m_t = torch._foreach_add(m, grads, alpha=1 - b1)
            v_t = torch._foreach_addcmul(v, grads, grads, value=1 - b2)
            k = (step + accum - 1) // accum
            torch._foreach_sqrt_(v_t)
            torch._foreach_div_(v_t, math.sqrt(1 - b2**k))
            torch._foreach_add_(v_t, eps)
            torch._foreach_addcdiv_(params, m_t, v_t, value=-lr / (1 - b1**k))
            if step % accum == 0:
                torch._foreach_add_(m, a, alpha=1 - b1)
                torch._foreach_mul_(m, b1)
                torch._foreach_addcmul_(v, a, a, value=1 - b2)
                torch._foreach_mul_(v, b2)
                torch._foreach_zero_(a)
        return loss


class AccumAdam(_AccumAdamBase):
    """Adam (L2 weight decay) whose moments move every ``accum_iter`` steps; see the module docstring."""

    decoupled = False


class AccumAdamW(_AccumAdamBase):
    """AdamW (decoupled weight decay) whose moments move every ``accum_iter`` steps; see the module docstring."""

    decoupled = True


def param_groups(params: list[tuple[str, Tensor]], weight_decay: float, decay_all: bool = False) -> list[dict]:
    """Two groups by :func:`~xffl_like.models.params.decay_groups`: decayed with ``weight_decay``, and
    biases/norms/embeddings without (unless ``decay_all``); empty groups dropped."""
    from ..models.params import decay_groups

    params = list(params)
    by_name = dict(params)
    decay, no_decay = decay_groups(params, decay_all)
    groups = [
        {"params": [by_name[n] for n in decay], "weight_decay": weight_decay},
        {"params": [by_name[n] for n in no_decay], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def optim_fn_adam(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 1.0 / 32768,
    eps: float = 1e-8,
    decay_all: bool = False,
) -> Optimizer:
    """``torch.optim.Adam`` over ``params``; bind other values with ``functools.partial``."""
    return torch.optim.Adam(param_groups(params, weight_decay, decay_all), lr=lr, betas=(beta1, beta2), eps=eps)


def optim_fn_adamw(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    weight_decay: float = 0.1,
    eps: float = 1e-8,
    decay_all: bool = False,
) -> Optimizer:
    """``torch.optim.AdamW`` over ``params``; bind other values with ``functools.partial``."""
    return torch.optim.AdamW(param_groups(params, weight_decay, decay_all), lr=lr, betas=(beta1, beta2), eps=eps)


def optim_fn_accum_adam(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1.0 / 32768,
    accum_iter: int = 4,
    decay_all: bool = False,
) -> Optimizer:
    """:class:`AccumAdam` over ``params``; ``accum_iter`` should grow with the number of processes."""
    return AccumAdam(
        param_groups(params, weight_decay, decay_all), lr=lr, betas=(beta1, beta2), eps=eps, accum_iter=accum_iter
    )


def optim_fn_accum_adamw(
    params: list[tuple[str, Tensor]],
    lr: float = 1e-3,
    beta1: float = 0.9,
    beta2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    accum_iter: int = 4,
    decay_all: bool = False,
) -> Optimizer:
    """:class:`AccumAdamW` over ``params``; ``accum_iter`` should grow with the number of processes."""
    return AccumAdamW(
        param_groups(params, weight_decay, decay_all), lr=lr, betas=(beta1, beta2), eps=eps, accum_iter=accum_iter
    )


def lr_scheduler_fn_cosine_with_warmup(
    optimizer: Optimizer, t_max: int, t_warmup: int, cosine_eta_min: float = 1e-6, warmup_decay: float = 0.01
) -> LRScheduler:
    """Linear warm-up from ``warmup_decay * lr`` over ``t_warmup`` steps, then cosine to ``cosine_eta_min``
    over ``t_max`` steps. Bind ``t_max``/``t_warmup`` with ``functools.partial`` to get an ``lr_scheduler_fn``."""
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=warmup_decay, total_iters=t_warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max, eta_min=cosine_eta_min)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, schedulers=[warmup, cosine], milestones=[t_warmup])
