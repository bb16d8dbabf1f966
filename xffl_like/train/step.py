"""One local optimizer step's forward and backward: the typed ``train`` config, micro-batches.

``TrainConfig.from_mapping`` (:func:`xffl_like.config.schema.job_config`, on the plain ``train`` dict)
checks every ``train.*``
value once, in the launching process; workers receive the checked object. :func:`accumulate_gradients`
runs the ``train.grad_accum`` micro-batches of one step; the optimizer step itself stays in
the loop.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..config.schema import ACTIVATION_CHECKPOINTING, TrainConfig

__all__ = ["ACTIVATION_CHECKPOINTING", "TrainConfig", "accumulate_gradients"]


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
        model.set_requires_gradient_sync(i == k - 1)
        with timer("data"):
            inputs, targets = (t.to(device, non_blocking=True) for t in micro_batch(i))
        with timer("forward"):
            loss = model(
                inputs, targets, loss_chunk=cfg.loss_chunk, checkpoint_layers=cfg.activation_checkpointing == "full"
            )
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
