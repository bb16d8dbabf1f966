"""The one exception type of a config problem, importable by every module that checks a section.

:class:`ConfigError` lives here, not in :mod:`.config`, so that the modules that own a section's
meaning (``parallel.options``, ``federation.options``, ``data``, ``aggregation``, ...) raise it
themselves without importing the launcher's validation.
"""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A config value that cannot work; the message is the one line shown to the user.

    A :class:`ValueError`, so that callers that catch ``ValueError`` keep working."""
