"""The torch APIs that changed name inside the supported range (``torch>=2.11``, pyproject.toml), one guarded
call each, so that the rest of the package reads the same on every supported torch.

Each is looked up when called, not when imported, so a test that wraps the ``torch.distributed`` function
sees every call."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["all_gather_single"]


def all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
    """Every rank's ``tensor`` (same shape everywhere) gathered into ``output`` (their concatenation or stack
    along the first dimension): ``torch.distributed.all_gather_single`` where torch has it (after 2.11, which
    deprecates the old name), else ``all_gather_into_tensor``, the same collective under its torch 2.11 name."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, tensor, group=group, async_op=async_op)
