"""Durable runs: DCP checkpoints (``dcp``), their files on disk (``store``), resume before launch (``resume``)."""

from .dcp import Checkpointer, checkpoint_dir, restart_count
from .store import latest_checkpoint

__all__ = ["Checkpointer", "checkpoint_dir", "latest_checkpoint", "restart_count"]
