"""How a facility reaches the hub: the hub's address (``federation.elastic.hub``), and the error that keeps a
facility out of the federation."""

from __future__ import annotations

from ...config.errors import ConfigError

__all__ = ["ElasticError", "address"]


class ElasticError(RuntimeError):
    """One line naming what keeps this facility out of the federation, and the fix."""


def address(value: str, key: str = "federation.elastic.hub") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ``ConfigError`` with one line otherwise."""
    text = str(value)
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:  # a bare IPv6 address: its port cannot be told from its last group
            sep = ""
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{key}={value!r}: must be HOST:PORT or [IPv6]:PORT (the address `python -m xffl_like.hub serve` "
            f"prints, e.g. login1:29510)"
        )
    return host, int(port)
