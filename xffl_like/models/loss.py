"""Cross-entropy of a language-model head, chunked over the sequence.

The logits of a whole batch are ``batch x seq x vocab``: with a 128k vocabulary at 8k tokens
they alone are tens of GB in fp32. :func:`chunked_cross_entropy` applies the head (final norm
and output projection) to ``chunk`` positions at a time and upcasts only that chunk to fp32.
Under autograd every chunk is checkpointed: the backward pass recomputes one chunk's logits
at a time from its hidden states instead of keeping every chunk's logits alive, so at most one
chunk's logits exist at any moment. It is called inside the model's ``forward`` so that FSDP2
holds the head's parameters gathered for it (see ``Llama.forward``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

__all__ = ["chunk_loss_sum", "chunked_cross_entropy"]


def chunk_loss_sum(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The summed cross-entropy of one chunk: ``head`` (final norm, output projection), the fp32 upcast, the
    log-softmax. Compiled (``train.compile``: :func:`xffl_like.train.speed.compile_blocks`), the upcast and the
    reductions fuse into kernels that read the head's output once, instead of a fp32 copy of the chunk's logits
    and separate passes over it."""
    logits = head(hidden)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def chunked_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    chunk: int,
    loss_sum: Callable[..., torch.Tensor] = chunk_loss_sum,
) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``, ``chunk`` positions at a time.

    ``hidden`` is ``[batch, seq, dim]`` (before the head), ``targets`` ``[batch, seq]``. Equal to
    ``F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten())`` up to fp rounding,
    gradients included. ``chunk >= seq`` computes it in one piece. ``loss_sum``: :func:`chunk_loss_sum`, or
    its compiled form.
    """
    if chunk <= 0:
        raise ValueError(f"loss chunk={chunk}: must be a positive number of positions")
    seq = hidden.shape[1]
    if chunk >= seq:
        return loss_sum(head, hidden, targets) / targets.numel()
    recompute = torch.is_grad_enabled()  # under no_grad nothing is kept: no checkpoint needed
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, seq, chunk):
        h, t = hidden[:, start : start + chunk], targets[:, start : start + chunk]
        if recompute:
            total = total + checkpoint(loss_sum, head, h, t, use_reentrant=False)
        else:
            total = total + loss_sum(head, h, t)
    return total / targets.numel()
