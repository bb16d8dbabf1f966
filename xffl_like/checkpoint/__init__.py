"""Durable runs and model files: DCP checkpoints (``dcp``), staged to host memory (``staging``),
their files on disk (``store``, no torch), DCP's files read without executing code (``safe``), resume before
launch (``resume``), Hugging Face safetensors import/export (``hf``).

The package imports nothing heavy itself: the launcher reads the checkpoint directory (``store``) before any
worker starts, and ``torch.distributed.checkpoint`` (about 0.7 s of CPU) is imported by the modules that use it.
"""

from typing import Any

from .store import checkpoint_dir, latest_checkpoint

__all__ = ["Checkpointer", "checkpoint_dir", "latest_checkpoint", "restart_count"]


def __getattr__(name: str) -> Any:  # the workers' names, from .dcp on first use
    if name in ("Checkpointer", "restart_count"):
        from . import dcp

        return getattr(dcp, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
