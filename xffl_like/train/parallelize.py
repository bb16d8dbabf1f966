"""How the model is sharded inside a facility: FSDP2 on each decoder block and the root."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from ..distributed.state import DistributedState

__all__ = ["DTYPES", "shard_model"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def shard_model(model: nn.Module, state: DistributedState, dtype: str = "float32") -> nn.Module:
    """Apply ``fully_shard`` over the facility mesh (1-D FSDP or 2-D HSDP), in place.

    Weights stay fp32; ``dtype=bfloat16`` computes in bf16 and reduces gradients in fp32.
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=state.mesh, mp_policy=policy)
    fully_shard(model, mesh=state.mesh, mp_policy=policy)
    return model
