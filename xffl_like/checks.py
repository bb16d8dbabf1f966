"""Type predicates for validating config values (YAML and Hydra give ``True`` where a number
is expected as easily as ``1``, and ``bool`` is an ``int`` in Python)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_int", "is_number"]


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
