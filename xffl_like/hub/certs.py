"""The hub's identities loaded when needed: ``serve --insecure`` makes no certificate and checks none, so it must
start on a machine without the ``cryptography`` package (a GPU image, a laptop demo). :mod:`.identity`, which
needs it, is imported only by :func:`identity`, which names the missing package in one line."""

from __future__ import annotations

from .errors import IdentityError

__all__ = ["identity"]


def identity():
    """The :mod:`xffl_like.hub.identity` module, or :class:`IdentityError` naming the package it needs."""
    try:
        from . import identity as module
    except ImportError as exc:  # ModuleNotFoundError, or a shim's "import of cryptography halted"
        if (exc.name or "").split(".")[0] != "cryptography" and "cryptography" not in str(exc):
            raise
        raise IdentityError(
            "certificates (init, add, revoke, serve with mutual TLS) need the `cryptography` package, which is not "
            "installed: pip install cryptography (serve --insecure on loopback needs none)"
        ) from None
    return module
