"""How the model is sharded inside a facility: FSDP2 on each decoder block and the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from ..distributed.state import DistributedState
from ..models import build_model
from ..schema import ModelConfig

__all__ = ["DTYPES", "build_sharded_model", "contiguous_shards", "peak_rss_mb", "shard_model"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard_model(model: nn.Module, state: DistributedState, dtype: str = "float32") -> nn.Module:
    """Apply ``fully_shard`` over the facility mesh (1-D FSDP or 2-D HSDP), in place.

    Weights stay fp32; ``dtype=bfloat16`` computes in bf16 and reduces gradients in fp32. The
    blocks do not cast their inputs: the hidden state already has the compute dtype (the embedding
    is in it), and the RoPE tables, also a block input, must stay fp32 (bf16 angles are off by
    up to ~0.4% at the longest positions).
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    block_policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[dtype], reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    for block in model.layers:
        fully_shard(block, mesh=state.mesh, mp_policy=block_policy)
    fully_shard(model, mesh=state.mesh, mp_policy=policy)
    return model


def build_sharded_model(
    cfg_model: ModelConfig, state: DistributedState, dtype: str = "float32", seed: int = 0
) -> nn.Module:
    """The facility's sharded model, initialised from ``seed`` or loaded from ``model.path`` (HF).

    ``model.init=meta``: build on the meta device, ``fully_shard``, allocate only the local
    shards (``to_empty``), then fill them: each rank draws just the init blocks of its rows
    (values independent of the layout, see ``Llama.init_weights``) or reads just its rows of
    the safetensors files. ``model.init=full``: every rank builds and initialises the whole
    model first (same values), then shards it: simple, but the peak memory is the full model.
    """
    path = cfg_model.path
    if cfg_model.init == "meta":
        model = build_model(cfg_model, device="meta")
        shard_model(model, state, dtype)
        model.to_empty(device=state.device)
        if not path:
            model.init_weights(seed)
    else:
        model = build_model(cfg_model, seed=seed)  # on CPU; fully_shard moves the shards to the device
        shard_model(model, state, dtype)
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


@torch.no_grad()
def contiguous_shards(model: nn.Module, shard_size: int) -> int:
    """Move the local shards of evenly sharded parameters into one flat buffer per dtype.

    Call after ``fully_shard``, before the optimizer; a forward may already have run (the
    reset below re-points FSDP's all-gather inputs, which its lazy init would not redo). Neighbouring
    parameters then sit side by side in memory, so an aggregation bucket is one view of the
    buffer: no copy-in/copy-out and one message per bucket (see the ``fused`` strategy).
    Parameters whose sharded dimension does not divide evenly keep FSDP's padded storage.
    FSDP2 picks up the new storage through ``FSDPParam.reset_sharded_param``, the hook it
    runs for ``load_state_dict(assign=True)`` and ``to_empty``. Returns the bytes moved.
    """
    chosen: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in model.parameters():
        local = getattr(param, "_local_tensor", None)
        if local is None or param.dim() == 0 or param.shape[0] % shard_size or not local.is_contiguous():
            continue
        chosen.setdefault(local.dtype, []).append(local)
    moved = 0
    for dtype, locals_ in chosen.items():
        flat = torch.empty(sum(t.numel() for t in locals_), dtype=dtype, device=locals_[0].device)
        offset = 0
        for local in locals_:
            view = flat[offset : offset + local.numel()].view_as(local)
            view.copy_(local)
            local.set_(view)  # the parameter's own local tensor now lives in ``flat``
            offset += local.numel()
        moved += flat.numel() * flat.element_size()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                fsdp_param.reset_sharded_param()
    return moved
