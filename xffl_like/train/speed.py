"""The speed knobs whose default depends on the device: ``train.dtype=auto``, ``train.compile=auto``, fused AdamW.

Chosen for CUDA, and the CPU job unchanged: ``auto`` is bfloat16 and compiled blocks on CUDA, float32 and
eager on the CPU; AdamW is fused where its parameters live on a non-CPU device torch has fused kernels for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import nn

from ..models.loss import chunk_loss_sum

__all__ = ["DETERMINISTIC_ENV", "compile_blocks", "compiles", "compute_dtype", "fused_adamw", "pin_determinism"]


def compute_dtype(dtype: str, device: torch.device) -> str:
    """``train.dtype`` on ``device``: ``auto`` is ``bfloat16`` on CUDA, ``float32`` elsewhere. Weights and the
    gradient reduction stay float32 whatever it is (:func:`~.parallelize.shard_model`'s policy)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


def compiles(value, device: torch.device) -> bool:
    """``train.compile`` on ``device``: ``auto`` compiles on CUDA only."""
    return torch.device(device).type == "cuda" if value == "auto" else bool(value)


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` each decoder block's ``forward`` in place (as torchtitan compiles per block: the blocks
    are alike, so one graph serves them all). The modules, their parameter names and FSDP2's hooks stay as they
    are: the hooks run around the compiled forward (all-gather before it, reshard after), activation
    checkpointing wraps it. The loss is compiled too, one chunk's function (``model.chunk_loss``: final norm, head,
    fp32 cross-entropy), so that its upcast and log-softmax fuse instead of copying each chunk's logits to fp32.
    Returns the blocks compiled."""
    for block in model.layers:
        block.forward = torch.compile(block.forward, backend=backend)
    model.chunk_loss = torch.compile(chunk_loss_sum, backend=backend)
    return len(model.layers)


def fused_adamw(params: Iterable[torch.Tensor], offload: bool = False) -> bool:
    """Whether AdamW over ``params`` runs fused: all on one device type that has fused kernels (CUDA, XPU, ...),
    not the CPU (a CPU job keeps the foreach implementation and its figures), except under ``offload``
    (``parallel.cpu_offload``: the optimizer steps the host's shards, where fused is the faster kernel)."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

        supported = set(_get_fused_kernels_supported_devices())
    except ImportError:  # pragma: no cover - an older torch
        supported = {"cuda"}
    kinds = {p.device.type for p in params}
    return len(kinds) == 1 and kinds <= (supported if offload else supported - {"cpu"})


#: The environment of a job whose results are compared bitwise (``bench.gpu``'s checkpoint, hub and streams2
#: checks): :func:`pin_determinism` reads the first; cuBLAS reads the second when CUDA starts (its fixed
#: workspace is what makes its matrix products reproducible, and what deterministic algorithms require).
DETERMINISTIC_ENV = {"XFFL_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def pin_determinism() -> bool:
    """With ``XFFL_DETERMINISTIC=1`` in the environment: ``torch.use_deterministic_algorithms(True)`` (an op
    without a deterministic implementation warns rather than stops the job: the bitwise comparison then says
    whether it mattered) and cuDNN's autotuner off. Whether it pinned."""
    if os.environ.get("XFFL_DETERMINISTIC") != "1":
        return False
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False
    return True
