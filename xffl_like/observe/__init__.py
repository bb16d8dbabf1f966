"""Metrics sinks, timers and progress."""

from .observer import Observer

__all__ = ["Observer"]
