"""What runs leave behind and show: local metric files, W&B, progress, phase timers, plots, sweep summaries."""

from .observer import Observer

__all__ = ["Observer"]
