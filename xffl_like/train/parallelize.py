"""How the model is sharded inside a facility: FSDP2 on each decoder block and the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ..config.schema import ModelConfig
from ..distributed.state import DistributedState
from ..models import build_model

__all__ = [
    "DTYPES",
    "build_sharded_model",
    "contiguous_shards",
    "materialize_contiguous",
    "reshard_all",
    "peak_rss_mb",
    "shard_model",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard_model(model: nn.Module, state: DistributedState, dtype: str = "float32", offload: bool = False) -> nn.Module:
    """Apply ``fully_shard`` over the facility mesh (1-D FSDP or 2-D HSDP), in place.

    Weights stay fp32; ``dtype=bfloat16`` computes in bf16 and reduces gradients in fp32. The
    blocks do not cast their inputs: the hidden state already has the compute dtype (the embedding
    is in it), and the RoPE tables, also a block input, must stay fp32 (bf16 angles are off by
    up to ~0.4% at the longest positions). ``offload`` (``parallel.cpu_offload``, CUDA only):
    FSDP2's ``CPUOffloadPolicy``, the sharded parameters, their gradients and so the optimizer
    state in pinned host memory; each group's all-gather copies its shards to the GPU. On a shard group of one
    rank the blocks keep their gathered parameters from the forward to the backward (``reshard_after_forward``
    off); a forward without a backward (an evaluation) must :func:`reshard_all` after it.
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    block_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[dtype], reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    offload_policy = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
    # A shard group of one rank holds every parameter whole: freeing each block's gathered copy after its forward
    # would only make the backward gather (copy) it again, so the copy stays until the backward frees it.
    reshard = state.shard_size > 1
    for block in model.layers:
        fully_shard(
            block, mesh=state.mesh, mp_policy=block_policy, offload_policy=offload_policy, reshard_after_forward=reshard
        )
    fully_shard(model, mesh=state.mesh, mp_policy=policy, offload_policy=offload_policy)
    return model


def reshard_all(model: nn.Module) -> None:
    """Free every FSDP module's gathered parameters (the root's, and the blocks' on a one-rank shard group, kept
    after a forward for the backward): after a forward with no backward they would stay, and be stale once an
    aggregation changes the shards."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@torch.no_grad()
def forward_param_dtype(model: nn.Module) -> str:
    """The dtype the first decoder block's parameters have inside a forward: FSDP2 all-gathers them into its
    ``param_dtype`` there (``train.dtype`` taking effect, or not), what a check of bf16 reads. Collective over
    the facility for a sharded model (one all-gather of that block); a plain model's own dtype."""
    block = model.layers[0] if hasattr(model, "layers") and len(model.layers) else model
    if not isinstance(block, FSDPModule):
        return str(next(block.parameters()).dtype).removeprefix("torch.")
    block.unshard()  # the parameters the forward computes with
    try:
        return str(next(block.parameters()).dtype).removeprefix("torch.")
    finally:
        block.reshard()


def build_sharded_model(
    cfg_model: ModelConfig, state: DistributedState, dtype: str = "float32", seed: int = 0, offload: bool = False
) -> nn.Module:
    """The facility's sharded model, initialised from ``seed`` or loaded from ``model.path`` (HF).

    ``model.init=meta``: build on the meta device, ``fully_shard``, allocate only the local
    shards, straight in the flat buffer of :func:`contiguous_shards` (:func:`materialize_contiguous`:
    one copy of the weights, never two), then fill them: each rank draws just the init blocks of
    its rows (values independent of the layout, see ``Llama.init_weights``) or reads just its rows
    of the safetensors files. ``model.init=full``: every rank builds and initialises the whole
    model first (same values), then shards it: simple, but the peak memory is the full model.
    ``offload``: see :func:`shard_model` (the shards, flat buffer included, in pinned host memory).
    """
    path = cfg_model.path
    if cfg_model.init == "meta":
        model = build_model(cfg_model, device="meta")
        shard_model(model, state, dtype, offload)
        materialize_contiguous(model, state.device, state.shard_size, pin_memory=offload)
        if not path:
            model.init_weights(seed)
    else:
        model = build_model(cfg_model, seed=seed)  # on CPU; fully_shard moves the shards to the device
        shard_model(model, state, dtype, offload)
    if path:
        from ..checkpoint.hf import load_hf_weights

        load_hf_weights(model, path)
    return model


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux ``VmHWM``; else ``ru_maxrss``)."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:  # pragma: no cover - not Linux
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def _evenly_sharded(param: torch.Tensor, shard_size: int) -> torch.Tensor | None:
    """The local shard of an FSDP2 parameter that :func:`contiguous_shards` places in its flat buffer (its
    sharded dimension divides evenly, so FSDP keeps no padding), else None."""
    local = getattr(param, "_local_tensor", None)
    if local is None or param.dim() == 0 or param.shape[0] % shard_size or not local.is_contiguous():
        return None
    return local


def _fsdp_params(model: nn.Module) -> dict[int, object]:
    """``id(sharded parameter) -> FSDPParam`` over every FSDP2 module of ``model``."""
    found = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                found[id(fsdp_param.sharded_param)] = fsdp_param
    return found


def _back_to_back(locals_: list[torch.Tensor]) -> bool:
    """Whether ``locals_`` already fill one storage, in order, from its start."""
    storage = locals_[0].untyped_storage()
    size = locals_[0].element_size()
    at = storage.data_ptr()
    for t in locals_:
        if t.untyped_storage().data_ptr() != storage.data_ptr() or t.data_ptr() != at:
            return False
        at += t.numel() * size
    return at - storage.data_ptr() == storage.nbytes()


@torch.no_grad()
def materialize_contiguous(model: nn.Module, device: torch.device, shard_size: int, *, pin_memory: bool = False) -> int:
    """``model.to_empty(device)`` for a model sharded on the meta device, with the layout of
    :func:`contiguous_shards` from the start: the evenly sharded parameters' local shards are views
    of one flat buffer per dtype, the others (and the buffers) get their own storage as ``to_empty``
    gives them. Nothing is copied, so the weights are never held twice. ``pin_memory``
    (``CPUOffloadPolicy``): the parameters go to pinned host memory, the buffers to ``device``.
    Values are uninitialised: fill them (``init_weights``, ``load_hf_weights``). Returns the
    bytes of the flat buffers."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
    from torch.distributed.tensor import DTensor

    param_device = torch.device("cpu") if pin_memory else device
    chosen: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        if _evenly_sharded(param, shard_size) is not None:
            chosen.setdefault(param.dtype, []).append(param)
    placed: dict[int, torch.Tensor] = {}
    total = 0
    for dtype, params in chosen.items():
        size = sum(p._local_tensor.numel() for p in params)
        flat = torch.empty(size, dtype=dtype, device=param_device, pin_memory=pin_memory)
        offset = 0
        for p in params:
            local = p._local_tensor
            view = flat[offset : offset + local.numel()].view(local.shape)
            placed[id(p)] = _from_local_no_grad(view, p._spec)
            offset += local.numel()
        total += flat.numel() * flat.element_size()

    def allocate(t: torch.Tensor) -> torch.Tensor:
        if id(t) in placed:
            return placed[id(t)]
        return torch.empty_like(t, device=param_device if isinstance(t, DTensor) else device)

    model._apply(allocate)  # as to_empty: FSDP's _apply then runs reset_sharded_param on every parameter
    return total


@torch.no_grad()
def contiguous_shards(model: nn.Module, shard_size: int) -> int:
    """Move the local shards of evenly sharded parameters into one flat buffer per dtype.

    Call after ``fully_shard``, before the optimizer; a forward may already have run (the
    reset below re-points FSDP's all-gather inputs, which its lazy init would not redo). Neighbouring
    parameters then sit side by side in memory, so an aggregation bucket is one view of the
    buffer: no copy-in/copy-out and one message per bucket (see the ``fused`` strategy), and
    async checkpoint staging copies one tensor per rank.
    Parameters whose sharded dimension does not divide evenly keep FSDP's padded storage.
    FSDP2 picks up the new storage through ``FSDPParam.reset_sharded_param``, the hook it
    runs for ``load_state_dict(assign=True)`` and ``to_empty``: each parameter right after its
    copy, so its old storage is released as the buffer fills (about one copy of the shards at a
    time, plus one parameter). Shards already in that layout (``model.init=meta``:
    :func:`materialize_contiguous`) stay where they are. A pinned shard (``CPUOffloadPolicy``)
    moves to a pinned buffer. Returns the bytes moved.
    """
    chosen: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        local = _evenly_sharded(param, shard_size)
        if local is not None:
            chosen.setdefault(local.dtype, []).append(param)
    fsdp_params = _fsdp_params(model)
    moved = 0
    for dtype, params in chosen.items():
        locals_ = [p._local_tensor for p in params]
        if _back_to_back(locals_):
            continue
        pinned = locals_[0].is_pinned()
        flat = torch.empty(sum(t.numel() for t in locals_), dtype=dtype, device=locals_[0].device, pin_memory=pinned)
        offset = 0
        for param, local in zip(params, locals_):
            view = flat[offset : offset + local.numel()].view_as(local)
            view.copy_(local)
            local.set_(view)  # the parameter's own local tensor now lives in ``flat``
            if id(param) in fsdp_params:  # FSDP's all-gather input too: the old storage is free
                fsdp_params[id(param)].reset_sharded_param()
            offset += local.numel()
        moved += flat.numel() * flat.element_size()
    return moved
