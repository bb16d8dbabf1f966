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

__all__ = ["chunked_cross_entropy"]


def _chunk_loss_sum(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    logits = head(hidden)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")


def chunked_cross_entropy(
    head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor, chunk: int
) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``, ``chunk`` positions at a time.

    ``hidden`` is ``[batch, seq, dim]`` (before the head), ``targets`` ``[batch, seq]``. Equal to
    ``F.cross_entropy(head(hidden).flatten(0, 1).float(), targets.flatten())`` up to fp rounding,
    gradients included. ``chunk >= seq`` computes it in one piece.
    """
    if chunk <= 0:
        raise ValueError(f"loss chunk={chunk}: must be a positive number of positions")
    seq = hidden.shape[1]
    if chunk >= seq:
        return _chunk_loss_sum(head, hidden, targets) / targets.numel()
    recompute = torch.is_grad_enabled()  # under no_grad nothing is kept: no checkpoint needed
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, seq, chunk):
        h, t = hidden[:, start : start + chunk], targets[:, start : start + chunk]
        if recompute:
            total = total + checkpoint(_chunk_loss_sum, head, h, t, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(head, h, t)
    return total / targets.numel()
