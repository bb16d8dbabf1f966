"""One local optimizer step's forward and backward: the typed ``train`` config, micro-batches.

``TrainConfig.from_mapping(cfg["train"])`` checks every ``train.*`` value once, in the
launching process; workers rebuild it from the validated dict. :func:`accumulate_gradients`
runs the ``train.grad_accum`` micro-batches of one step; the optimizer step itself stays in
the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping

import torch
from torch.distributed.fsdp import FSDPModule

__all__ = ["ACTIVATION_CHECKPOINTING", "TrainConfig", "accumulate_gradients"]

ACTIVATION_CHECKPOINTING = ("none", "full")
_DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class TrainConfig:
    """``conf/train/default.yaml``, checked."""

    #: Local optimizer steps in total.
    steps: int
    #: Sequences per rank per micro-batch.
    batch_size: int
    #: Tokens per sequence.
    seq_len: int
    dtype: Literal["float32", "bfloat16"] = "float32"
    log_every: int = 10
    #: Micro-batches per optimizer step; gradients are reduced inside the facility only after the last.
    grad_accum: int = 1
    #: ``full``: every decoder block recomputes its activations in the backward pass.
    activation_checkpointing: Literal["none", "full"] = "none"
    #: Sequence positions per chunk of the loss head (final norm, output projection, cross-entropy).
    loss_chunk: int = 1024
    #: Steps between evaluations of the local model (0: only right before and after each aggregation).
    eval_every: int = 0

    @classmethod
    def from_mapping(cls, m: Mapping[str, Any]) -> "TrainConfig":
        """Build from ``cfg["train"]`` (keys other components own are ignored); one-line ``ValueError`` on a bad value."""

        def integer(key: str, low: int, default: Any = None) -> int:
            value = m.get(key, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"train.{key}={value!r}: must be an integer >= {low} (e.g. train.{key}={max(low, 1)})")
            return value

        def choice(key: str, options: tuple[str, ...], default: str) -> str:
            value = m.get(key, default)
            if value not in options:
                raise ValueError(f"train.{key}={value!r}: use one of {', '.join(options)}")
            return value

        return cls(
            steps=integer("steps", 0), batch_size=integer("batch_size", 1), seq_len=integer("seq_len", 1),
            dtype=choice("dtype", _DTYPES, "float32"), log_every=integer("log_every", 1, 10),
            grad_accum=integer("grad_accum", 1, 1),
            activation_checkpointing=choice("activation_checkpointing", ACTIVATION_CHECKPOINTING, "none"),
            loss_chunk=integer("loss_chunk", 1, 1024), eval_every=integer("eval_every", 0, 0),
        )


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    cfg: TrainConfig,
    device: torch.device,
    timer: Callable | None = None,
) -> torch.Tensor:
    """Forward and backward of ``cfg.grad_accum`` micro-batches; return their mean loss (detached).

    ``micro_batch(i)`` gives micro-batch ``i`` of this step as (inputs, targets). Each loss is
    divided by ``grad_accum``, so the accumulated gradient is the one of the mean loss over the
    step's ``grad_accum * batch_size`` sequences. On an FSDP2 model the gradient reduction
    inside the facility (reduce-scatter, and the all-reduce across HSDP replicas) runs only in
    the last micro-batch's backward; the earlier ones accumulate unsharded gradients locally.
    ``timer(phase)`` (a :class:`~xffl_like.observe.timing.PhaseTimer`) times data, forward, backward.
    """
    timer = timer or _no_timer
    k = cfg.grad_accum
    total = torch.zeros((), dtype=torch.float64, device=device)
    for i in range(k):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(i == k - 1)
        elif hasattr(model, "set_accumulate_grad"):  # DecentralizedDataParallel: update after the last only
            model.set_accumulate_grad(i < k - 1)
        with timer("data"):
            inputs, targets = (t.to(device, non_blocking=True) for t in micro_batch(i))
        with timer("forward"):
            loss = model(inputs, targets, loss_chunk=cfg.loss_chunk,
                         checkpoint_layers=cfg.activation_checkpointing == "full")
        with timer("backward"):
            (loss / k).backward()
        total += loss.detach().double()
    return total / k


class _NoTimer:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _no_timer(phase: str) -> _NoTimer:
    return _NoTimer()
