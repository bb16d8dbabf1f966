"""The local optimizer: its typed config, parameter groups and learning-rate schedule.

``OptimConfig.from_mapping(cfg["optim"])`` checks every ``optim.*`` value once, in the
launching process (``xffl_like/config.py``); workers rebuild it from the validated dict and
call :func:`build_optimizer` and :func:`build_scheduler`. The schedule is a
``LambdaLR`` whose factor is a small callable object, so ``scheduler.state_dict()`` holds
plain values and a checkpoint can restore it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Mapping

import torch
from torch import Tensor, nn

__all__ = ["OPTIMIZERS", "SCHEDULES", "OptimConfig", "Schedule", "build_optimizer", "build_scheduler",
           "decay_groups"]

OPTIMIZERS = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine", "linear")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class OptimConfig:
    """``conf/optim/*.yaml``, checked. Keys of the other optimizer are absent from its file."""

    #: ``adamw`` (decoupled weight decay) or ``sgd`` (momentum, L2 weight decay).
    name: Literal["adamw", "sgd"]
    #: Peak learning rate (reached at the end of the warm-up).
    lr: float
    weight_decay: float = 0.0
    #: Linear warm-up steps from ``lr / warmup_steps`` to ``lr``.
    warmup_steps: int = 0
    #: After the warm-up: ``constant`` at ``lr``, or ``cosine`` / ``linear`` decay to ``min_lr``.
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    #: Learning rate of the last step for ``cosine`` and ``linear`` (ignored by ``constant``).
    min_lr: float = 0.0
    #: ``False``: norms, biases and embeddings get no weight decay (:func:`decay_groups`); ``True``: every parameter does.
    decay_all: bool = False
    #: Max global gradient norm; 0 disables clipping.
    grad_clip: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)  # adamw
    eps: float = 1e-8  # adamw
    momentum: float = 0.0  # sgd

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "OptimConfig":
        """Build from ``cfg["optim"]``; raise ``ValueError`` with one line naming the key and the fix."""
        name = m.get("name")
        if name not in OPTIMIZERS:
            raise ValueError(f"optim.name={name!r}: use one of {', '.join(OPTIMIZERS)} (e.g. optim=adamw or optim=sgd)")

        def number(key: str, low: float = 0.0, strict: bool = False, default: Any = None) -> float:
            value = m.get(key, default)
            if not _number(value) or value < low or (strict and value == low):
                what = "a positive number" if strict else f"a number >= {low:g}"
                raise ValueError(f"optim.{key}={value!r}: must be {what} (e.g. optim.{key}={default if default is not None else 1})")
            return float(value)

        warmup = m.get("warmup_steps", 0)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"optim.warmup_steps={warmup!r}: must be an integer >= 0 (e.g. optim.warmup_steps=0)")
        schedule = m.get("schedule", "constant")
        if schedule not in SCHEDULES:
            raise ValueError(f"optim.schedule={schedule!r}: use one of {', '.join(SCHEDULES)}")
        decay_all = m.get("decay_all", False)
        if not isinstance(decay_all, bool):
            raise ValueError(f"optim.decay_all={decay_all!r}: must be true or false")
        lr = number("lr", strict=True, default=1e-3)
        min_lr = number("min_lr", default=0.0)
        if min_lr > lr:
            raise ValueError(f"optim.min_lr={min_lr:g} exceeds optim.lr={lr:g}: the schedule decays from lr down to "
                             f"min_lr, so set optim.min_lr <= optim.lr")
        kwargs: dict[str, Any] = {}
        if name == "adamw":
            betas = m.get("betas", (0.9, 0.999))
            if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(_number(b) and 0 <= b < 1 for b in betas)):
                raise ValueError(f"optim.betas={betas!r}: must be two numbers in [0, 1) (e.g. optim.betas=[0.9,0.95])")
            kwargs = {"betas": (float(betas[0]), float(betas[1])), "eps": number("eps", strict=True, default=1e-8)}
        else:
            kwargs = {"momentum": number("momentum", default=0.0)}
            if kwargs["momentum"] >= 1:
                raise ValueError(f"optim.momentum={kwargs['momentum']:g}: must be in [0, 1) (e.g. optim.momentum=0.9)")
        return cls(name=name, lr=lr, weight_decay=number("weight_decay", default=0.0), warmup_steps=warmup,
                   schedule=schedule, min_lr=min_lr, decay_all=decay_all, grad_clip=number("grad_clip", default=0.0),
                   **kwargs)


_EMBEDDING_NAMES = ("wte", "wpe")  # GPT-2's embedding modules, whose names do not say "embed"


def decay_groups(params: nn.Module | Iterable[tuple[str, Tensor]], decay_all: bool = False) -> tuple[list[str], list[str]]:
    """Names of the parameters that get weight decay, and of those that do not: the one rule of
    the project, used by the main job's optimizer and by the ``xffl_like.parallel`` factories.

    ``params`` is a module or ``(name, parameter)`` pairs (what DecentralizedDataParallel
    passes to its ``optim_fn``, one bucket at a time). Without ``decay_all``, biases and norm
    gains (every parameter with fewer than 2 dimensions) and embedding tables get none:
    shrinking a norm's gain or a rare token's row towards zero is not regularisation. A
    module's embeddings are its ``nn.Embedding`` weights (so also a head tied to one); in
    pairs, a parameter whose module name contains ``embed`` (``tok_embeddings``,
    ``embed_tokens``, ``word_embeddings``) or is ``wte``/``wpe``. Each shared parameter is
    listed once, under its first name. ``decay_all``: every parameter decays.
    """
    embeddings: set[int] = set()
    if isinstance(params, nn.Module):
        embeddings = {id(m.weight) for m in params.modules() if isinstance(m, nn.Embedding)}
        params = params.named_parameters()

    def exempt(name: str, param: Tensor) -> bool:
        module = name.rsplit(".", 1)[0].split(".")[-1].lower() if "." in name else ""
        return (param.ndim < 2 or id(param) in embeddings or "embed" in module or module in _EMBEDDING_NAMES)

    decay, no_decay, seen = [], [], set()
    for name, param in params:
        if id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if not decay_all and exempt(name, param) else decay).append(name)
    return decay, no_decay


def build_optimizer(model: nn.Module | Iterable[tuple[str, Tensor]], cfg: OptimConfig) -> torch.optim.Optimizer:
    """The optimizer of ``cfg.name`` over two groups: decayed and not decayed (empty groups are dropped).

    ``model``: a module, or ``(name, parameter)`` pairs (one bucket of DecentralizedDataParallel)."""
    if not isinstance(model, nn.Module):
        model = list(model)
    params = dict(model.named_parameters()) if isinstance(model, nn.Module) else dict(model)
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
