"""The outer optimizer: a step on the global weights with the round's pseudo-gradient.

Each round, ``delta = theta_global - mean_f(theta_f)`` (the facilities' mean update, with
the sign of a gradient) and the outer optimizer moves ``theta_global`` along it:

- ``average``: ``theta -= lr * delta`` (lr 1: the plain mean, today's FedAvg);
- ``momentum``: ``buf = momentum * buf + delta``; ``theta -= lr * buf`` (heavy ball);
- ``nesterov``: ``buf = momentum * buf + delta``; ``theta -= lr * (delta + momentum * buf)``
  (DiLoCo: lr 0.7, momentum 0.9; ``torch.optim.SGD(nesterov=True)``'s rule);
- ``adam``: Adam with bias correction on ``delta``.

The state lives in flat fp32 buffers that hold this rank's local shards of the aggregated
parameters side by side (never a full copy of the model), on the parameters' device or in
host memory (``offload``, pinned when the parameters are on a GPU). Every copy of the model
applies the same step to the same numbers, so all copies stay identical.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..config.checks import is_number
from ..config.errors import ConfigError
from ..config.schema import OuterConfig

__all__ = ["AFFINE_OUTERS", "OUTER_NAMES", "OuterOptimizer", "end_scale", "outer_step", "validate_outer"]

OUTER_NAMES = ("average", "nesterov", "momentum", "adam")
#: The rules whose one step is affine in its input (:func:`end_scale`).
AFFINE_OUTERS = ("average", "momentum", "nesterov")


def validate_outer(cfg: OuterConfig) -> None:
    """Check ``federation.outer`` (the section or a phase's); raises ``ValueError`` with one line naming the key."""
    if cfg.name not in OUTER_NAMES:
        raise ConfigError(f"federation.outer.name={cfg.name!r}: use one of {', '.join(OUTER_NAMES)}")

    def number(key, lo, hi, lo_open=False, hi_open=False):
        v = getattr(cfg, key)
        ok = is_number(v) and math.isfinite(v)
        ok = ok and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
        if not ok:
            span = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
            raise ConfigError(f"federation.outer.{key}={v!r}: must be a number in {span}")

    number("lr", 0.0, math.inf, lo_open=True, hi_open=True)
    number("momentum", 0.0, 1.0, hi_open=True)
    betas = cfg.betas
    if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and all(is_number(b) and 0 <= b < 1 for b in betas)):
        raise ConfigError(f"federation.outer.betas={betas!r}: must be two numbers in [0, 1), e.g. [0.9, 0.99]")
    number("eps", 0.0, math.inf, lo_open=True, hi_open=True)
    if not isinstance(cfg.offload, bool):
        raise ConfigError(f"federation.outer.offload={cfg.offload!r}: must be true or false")
    if cfg.name in ("nesterov", "momentum") and cfg.momentum == 0:
        raise ConfigError(f"federation.outer.name={cfg.name} needs federation.outer.momentum > 0 (DiLoCo: 0.9)")


def end_scale(options: OuterConfig) -> float:
    """``c`` with ``outer(θ, g + d) = outer(θ, g) - c d`` for one step of an :data:`AFFINE_OUTERS` rule from the same
    state: ``lr`` (average, momentum), ``lr (1 + momentum)`` (nesterov)."""
    return options.lr * (1.0 + options.momentum) if options.name == "nesterov" else options.lr


class OuterOptimizer:
    """The outer rule of ``options`` (validated by :func:`validate_outer`) over one flat fp32 ``theta``
    (this rank's shards)."""

    def __init__(self, options: OuterConfig, theta: Tensor):
        self.options = options
        self.theta = theta
        self.steps = 0
        zeros = lambda: torch.zeros_like(theta)  # noqa: E731 - same device/pinning as theta
        self.buffers: dict[str, Tensor] = {}
        if options.name in ("nesterov", "momentum"):
            self.buffers["momentum_buffer"] = zeros()
        elif options.name == "adam":
            self.buffers["exp_avg"] = zeros()
            self.buffers["exp_avg_sq"] = zeros()

    def fragment(self, start: int, stop: int) -> OuterOptimizer:
        """An optimizer over elements ``start:stop`` of ``theta`` whose state is that slice of this
        one's buffers (views: checkpoints see one flat state) with its own step count."""
        part = OuterOptimizer.__new__(OuterOptimizer)
        part.options, part.theta, part.steps = self.options, self.theta[start:stop], 0
        part.buffers = {k: v[start:stop] for k, v in self.buffers.items()}
        return part

    @torch.no_grad()
    def step(self, delta: Tensor) -> None:
        """Move ``theta`` in place along the pseudo-gradient ``delta`` (flat, fp32; may be overwritten)."""
        self.steps += 1
        outer_step(self.options, self.steps, self.theta, self.buffers, delta)


@torch.no_grad()
def outer_step(options: OuterConfig, steps: int, theta: Tensor, buffers: dict[str, Tensor], delta: Tensor) -> None:
    """The outer step number ``steps`` (counted from 1, the count after this round's increment) on ``theta`` and
    its state ``buffers``, in place along ``delta`` (may be overwritten). Elementwise: applied to any window
    (``theta[a:b]``, each buffer's ``[a:b]``, ``delta[a:b]``) with the round's one ``steps``, it gives bitwise
    the same values as on the whole tensors (the hub steps its state on disk window by window)."""
    o = options
    if o.name == "average":
        theta.sub_(delta, alpha=o.lr)
    elif o.name in ("momentum", "nesterov"):
        buf = buffers["momentum_buffer"]
        buf.mul_(o.momentum).add_(delta)
        if o.name == "nesterov":
            theta.sub_(delta.add_(buf, alpha=o.momentum), alpha=o.lr)
        else:
            theta.sub_(buf, alpha=o.lr)
    else:
        m, v = buffers["exp_avg"], buffers["exp_avg_sq"]
        b1, b2 = o.betas
        m.lerp_(delta, 1 - b1)
        v.mul_(b2).addcmul_(delta, delta, value=1 - b2)
        c1, c2 = 1 - b1**steps, 1 - b2**steps
        denom = (v / c2).sqrt_().add_(o.eps)
        theta.addcdiv_(m, denom, value=-o.lr / c1)
