"""Host copies of state dicts for DCP, and DTensors over a local tensor that stays where it is.

``DTensor.from_local(t, mesh)`` moves ``t`` to the mesh's device type when they differ
(``local_tensor.to(device_type)`` in torch's ``_api.py``): a host copy of a GPU model made
that way is copied straight back onto the GPU (a second device copy of the model, optimizer
and federation state at every save), and a CPU buffer (``federation.outer.offload=true``)
is copied to the GPU each time it is wrapped. :func:`dtensor_over` builds the DTensor
around the local tensor as it is, the way torch's own ``_create_cpu_state_dict`` keeps
CPU local tensors under a CUDA mesh; DCP reads and writes such DTensors (it only needs the
local tensor and the spec).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import TensorMeta

__all__ = ["HostStager", "dtensor_over", "host_copy"]


def dtensor_over(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements, global shape and stride whose local tensor is
    ``local`` itself (same storage, same device, ``local``'s dtype): nothing is copied or moved."""
    spec = dataclasses.replace(like._spec, tensor_meta=TensorMeta(like.shape, like.stride(), local.dtype))
    return DTensor(local.view_as(local), spec, requires_grad=False)


def host_copy(obj: Any, buffers: dict | None = None) -> Any:
    """A host-memory copy of a state dict (DTensors stay DTensors over the same mesh, with CPU
    local tensors). Complete when it returns: see :func:`_to_host`. With ``buffers`` (a dict kept by
    the caller) each tensor is copied into the host buffer of the same place, shape and dtype from an
    earlier call (pinned when the source is on a GPU), so that saves after the first allocate nothing.

    DCP's default stager deep-copies DTensors, which fails for parameters whose local shard
    is a view into the contiguous buffer of ``train.parallelize.contiguous_shards``.
    """
    devices: set[torch.device] = set()
    copy = _host_copy(obj, devices, buffers, ())
    # The copies were blocking (each waited on its source device's current stream); synchronize every
    # source GPU anyway: DCP's writer thread reads these tensors, and its own current device (cuda:0)
    # says nothing about a rank whose tensors live on cuda:<local rank>.
    for device in devices:
        torch.cuda.synchronize(device)
    return copy


def _to_host(t: torch.Tensor, devices: set, buffers: dict | None, key: tuple) -> torch.Tensor:
    if t.device.type == "cuda":
        devices.add(t.device)
    if buffers is None:
        # non_blocking=False: into pageable memory the copy is done when ``to`` returns.
        return t.detach().to("cpu", copy=True)
    buf = buffers.get(key)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
        buf = buffers[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")
    return buf.copy_(t.detach())  # blocking: done when it returns


def _host_copy(obj: Any, devices: set, buffers: dict | None, key: tuple) -> Any:
    if isinstance(obj, DTensor):
        return dtensor_over(_to_host(obj._local_tensor, devices, buffers, key), obj)
    if torch.is_tensor(obj):
        return _to_host(obj, devices, buffers, key)
    if isinstance(obj, dict):
        return {k: _host_copy(v, devices, buffers, (*key, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_host_copy(v, devices, buffers, (*key, i)) for i, v in enumerate(obj))
    return obj


class HostStager(AsyncStager):
    """Stages with :func:`host_copy` before ``async_save`` returns: training may then change
    the weights while the copy is written, and no device memory is held by the save. One stager per
    rank, kept across saves, reuses its host buffers (pinned for GPU tensors): the caller must not
    stage again before the previous save is written (the checkpointer never has two in flight)."""

    _synchronize_after_execute = False

    def __init__(self):
        self.buffers: dict = {}

    def stage(self, state_dict):
        return host_copy(state_dict, self.buffers)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
