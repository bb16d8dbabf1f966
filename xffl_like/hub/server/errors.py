"""The hub's refusal: one line for the facility and the gRPC status it travels with."""

from __future__ import annotations

__all__ = ["HubError"]


class HubError(RuntimeError):
    """A request the hub refuses (one line for the facility: what and the fix); ``code``: the gRPC status name."""

    def __init__(self, message: str, code: str = "FAILED_PRECONDITION"):
        super().__init__(message)
        self.code = code
