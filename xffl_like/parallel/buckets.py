"""What a Bagua algorithm sees of the module it serves: the gradient buckets (:class:`Bucket`) and the
:class:`AlgorithmHost` interface. :mod:`.algorithms` is written against these and
:mod:`.bagua`'s ``BaguaModule`` implements them, so neither of the two imports the other's
module for its types.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .runtime import NodeComm, flat_copy, unflatten_into

__all__ = ["AlgorithmHost", "Bucket"]


class Bucket:
    """Parameters communicated together; flat copies in and out."""

    def __init__(self, params: list[nn.Parameter]):
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.device, self.dtype = params[0].device, params[0].dtype

    def grads_flat(self) -> Tensor:
        """A flat copy of the gradients (zeros where a parameter got none)."""
        return flat_copy([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])

    def set_grads(self, flat: Tensor) -> None:
        """Write ``flat`` into the gradients."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        unflatten_into(flat, [p.grad for p in self.params])

    def weights_flat(self) -> Tensor:
        """A flat copy of the weights."""
        return flat_copy(self.params)

    @torch.no_grad()
    def set_weights(self, flat: Tensor) -> None:
        """Write ``flat`` into the weights."""
        unflatten_into(flat, self.params)


class AlgorithmHost(Protocol):
    """The module an :class:`~.algorithms.Algorithm` serves (:class:`~.bagua.BaguaModule`)."""

    #: The node layout and its process groups (see :func:`.comm.node_comm`).
    comm: NodeComm
    #: Gradient buckets, in the order their gradients become ready.
    buckets: list[Bucket]
    device: torch.device

    def async_group(self) -> dist.ProcessGroup:
        """A world-wide group for background threads (created once, collectively)."""
        ...
