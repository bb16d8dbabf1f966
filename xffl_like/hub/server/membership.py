"""The hub's members: who is in the federation, its session, its heartbeats and whether it is live.

A member is one facility (its name) run by one process (its session). A live member's name cannot be taken
by another session; one whose heartbeats stopped (:data:`LIVE_S`) or that left is not waited for, and a new
process of the same facility takes its place, keeping its history (recent update norms, last step).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from ..protocol.messages import Geometry, HubView
from ..protocol.retry import LIVE_S
from .errors import HubError

__all__ = ["HISTORY", "LIVE_S", "Member", "Membership"]

#: Accepted update norms kept per facility (together, the federation's recent accepted norms: :mod:`.checks`).
HISTORY = 5


@dataclass
class Member:
    name: str
    session: str
    geometry: Geometry
    every: int | None
    steps: int
    beat: float = field(default_factory=time.monotonic)
    last_step: int | None = None
    norms: list[float] = field(default_factory=list)
    left: bool = False
    counted: int | None = None  # the step of the last round that accepted its contribution
    share: float | None = None  # its weight in that round, over the round's total

    def history(self) -> dict[str, Any]:
        """What a member coming back (another session, a restarted hub) keeps."""
        return {"last_step": self.last_step, "norms": self.norms, "counted": self.counted, "share": self.share}

    def live(self, now: float) -> bool:
        return not self.left and now - self.beat < LIVE_S

    def durable(self) -> dict[str, Any]:
        """What the state keeps of it across restarts."""
        return {"geometry": self.geometry.to_json(), "every": self.every, "steps": self.steps, **self.history()}

    def accepted(self, step: int, norm: float | None, share: float | None = None) -> None:
        """A round at ``step`` committed; ``norm``: its accepted update's, ``share``: its weight (None: not
        accepted)."""
        self.last_step = step
        if norm is not None:
            self.norms = (self.norms + [norm])[-HISTORY:]
        if share is not None:
            self.counted, self.share = step, share


class Membership:
    """The members by name (the caller holds the federation's lock)."""

    def __init__(self, saved: dict[str, dict[str, Any]] | None = None):
        self.members: dict[str, Member] = {}
        for name, d in (saved or {}).items():
            m = Member(name, "", Geometry.from_json(d["geometry"]), d["every"], d["steps"], beat=-math.inf)
            m.last_step, m.norms = d["last_step"], list(d["norms"])
            m.counted, m.share = d.get("counted"), d.get("share")  # absent from a state saved before them
            self.members[name] = m

    def __getitem__(self, name: str) -> Member:
        return self.members[name]

    def live(self, now: float | None = None) -> set[str]:
        now = time.monotonic() if now is None else now
        return {n for n, m in self.members.items() if m.live(now)}

    def view(self, version: int, progress: int, ended: bool) -> HubView:
        return HubView(version=version, progress=progress, ended=ended, live=tuple(sorted(self.live())))

    def durable(self) -> dict[str, dict[str, Any]]:
        return {n: m.durable() for n, m in self.members.items()}

    def refuse_twin(self, name: str, session: str) -> None:
        """A live member of that name in another session: refused (each facility its own name)."""
        held = self.members.get(name)
        if held is not None and held.live(time.monotonic()) and held.session != session:
            raise HubError(
                f"a facility named {name} is already a member (its heartbeat is live): each facility "
                f"needs its own name and certificate (python -m xffl_like.hub add DIR NAME)",
                "ALREADY_EXISTS",
            )

    def admit(self, name: str, session: str, geometry: Geometry, every: int | None, steps: int) -> Member:
        """``name`` in ``session`` is a member now (one coming back keeps its history)."""
        member = Member(name, session, geometry, every, steps)
        held = self.members.get(name)
        if held is not None:
            member.norms, member.counted, member.share = held.norms, held.counted, held.share
        self.members[name] = member
        return member

    def member(self, name: str, session: str) -> Member:
        """The member ``name`` as ``session`` may speak for it (:class:`HubError` ``NOT_FOUND``: join again)."""
        m = self.members.get(name)
        if m is None or (m.session and m.session != session):
            if m is not None and m.session and not m.live(time.monotonic()):
                m.session = session  # the hub restarted or the facility's old process is gone
                return m
            raise HubError(f"facility {name} is not a member of this federation now: join again", "NOT_FOUND")
        if not m.session:
            m.session = session  # known from the saved state (the hub restarted): adopt this process
        return m

    def beat(self, name: str, session: str) -> Member:
        m = self.member(name, session)
        m.beat = time.monotonic()
        return m

    def leave(self, name: str, session: str) -> bool:
        """The member leaves if ``session`` is its own; whether it did."""
        m = self.members.get(name)
        if m is None or m.session != session:
            return False
        m.left = True
        return True
