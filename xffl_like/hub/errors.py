"""What the hub's command line and server need of its identities without the ``cryptography`` package.

``serve --insecure`` makes no certificate and checks none, so it must start on a machine without
``cryptography`` (a GPU image, a laptop demo): :mod:`.identity`, which needs it, is imported only by
:func:`identity`, which names the missing package in one line.
"""

from __future__ import annotations

__all__ = ["GRANT_KEYS", "IdentityError", "identity"]

#: What a grant may bound, and each one's largest value (the protocol's own bounds).
GRANT_KEYS = {"batch_size": 1 << 20, "seq_len": 1 << 24, "dp": 1 << 20, "steps": 1 << 62}


class IdentityError(ValueError):
    """One line: which file or name, what is wrong, and the fix."""


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
