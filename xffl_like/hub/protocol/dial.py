"""How a facility reaches the hub: the hub's address (``federation.elastic.hub``, checked by
:func:`xffl_like.config.checks.address`), and the error that keeps a facility out of the federation."""

from __future__ import annotations

from ...config.checks import address

__all__ = ["ElasticError", "address"]


class ElasticError(RuntimeError):
    """One line naming what keeps this facility out of the federation, and the fix."""
