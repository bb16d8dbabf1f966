"""Durable runs and model files: DCP checkpoints (``dcp``), staged to host memory (``staging``),
their files on disk (``store``), resume before launch (``resume``), Hugging Face safetensors
import/export (``hf``)."""

from .dcp import Checkpointer, checkpoint_dir, restart_count
from .store import latest_checkpoint

__all__ = ["Checkpointer", "checkpoint_dir", "latest_checkpoint", "restart_count"]
