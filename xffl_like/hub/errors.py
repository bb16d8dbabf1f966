"""What the hub's command line and server need of its identities without the ``cryptography`` package (the
module :mod:`.identity` itself, which needs it, is loaded by :func:`xffl_like.hub.certs.identity`)."""

from __future__ import annotations

__all__ = ["GRANT_KEYS", "IdentityError"]

#: What a grant may bound, and each one's largest value (the protocol's own bounds).
GRANT_KEYS = {"batch_size": 1 << 20, "seq_len": 1 << 24, "dp": 1 << 20, "steps": 1 << 62}


class IdentityError(ValueError):
    """One line: which file or name, what is wrong, and the fix."""
