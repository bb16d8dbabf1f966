"""A round's state, explicit: the round and each member's part in it move only along their transitions.

A round is ``OPEN`` from the first arrival at the hub's version; ``CLOSED`` once every live member arrived
and every upload ended (or ``grace_s`` passed): no one joins it any more; ``COMMITTING`` while the committer
computes and saves the next version (streams reading θ_global read the saved version's file meanwhile: none
is waited for, none waits);
``DECIDED`` with its outcome, which members waiting for it then read.

A member's part (:class:`Part`): ``HEAL`` (another version, or it came after the round closed: it receives
θ_global and contributes nothing), ``REFUSED`` (its claims cannot hold), ``WANTED`` (its upload is
expected), ``UPLOADING``, then ``UPLOADED`` or ``BROKEN`` (the upload was malformed, broke off, or had not
ended by the round's deadline: ``grace_s`` after it opened bounds the whole round, uploads included).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..protocol.messages import HubView, ResultHeader

__all__ = ["Arrival", "Outcome", "Part", "Round", "RoundState", "StateError"]


class StateError(RuntimeError):
    """A transition the round's state does not allow (a bug of the hub, never a facility's doing)."""


class RoundState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"
    COMMITTING = "committing"
    DECIDED = "decided"


class Part(enum.Enum):
    HEAL = "heal"
    REFUSED = "refused"
    WANTED = "wanted"
    UPLOADING = "uploading"
    UPLOADED = "uploaded"
    BROKEN = "broken"


#: The transitions each state allows.
ROUND_MOVES = {
    RoundState.OPEN: {RoundState.CLOSED},
    RoundState.CLOSED: {RoundState.COMMITTING},
    RoundState.COMMITTING: {RoundState.DECIDED},
    RoundState.DECIDED: set(),
}
PART_MOVES = {
    Part.WANTED: {Part.UPLOADING, Part.BROKEN},  # broken: no upload by the round's deadline
    Part.UPLOADING: {Part.UPLOADED, Part.BROKEN},
    Part.HEAL: set(),
    Part.REFUSED: set(),
    Part.UPLOADED: set(),
    Part.BROKEN: set(),
}


def _move(what: str, moves: dict, now, to):
    if to not in moves[now]:
        raise StateError(f"{what}: {now.value} cannot become {to.value}")
    return to


@dataclass
class Arrival:
    step: int
    taken: int
    tokens: float
    part: Part
    reason: str | None = None  # why its contribution is out (claims, upload, checks)
    spool: Path | None = None
    norm: float = math.nan
    crc: str | None = None  # a message's CRC-32, taken as it was spooled (:mod:`.journal`)
    cut: Callable[[], None] | None = None  # ends its upload's call (the round's deadline passed)
    received: int = 0  # bytes of its upload written to its spool file so far (:mod:`.ahead` folds them)

    def move(self, to: Part, reason: str | None = None) -> None:
        self.part = _move("an arrival", PART_MOVES, self.part, to)
        if reason is not None:
            self.reason = reason

    @property
    def heal(self) -> bool:
        """Told to heal (it contributes nothing and is not judged)."""
        return self.part is Part.HEAL

    @property
    def settled(self) -> bool:
        """Its upload is not pending: uploaded, broken, refused or healing."""
        return self.part not in (Part.WANTED, Part.UPLOADING)


@dataclass(frozen=True)
class Outcome:
    """A decided round: committed or not, the accepted members' weights, the rejected and healed ones' reasons,
    why it failed (``error``), and the hub's view after it."""

    committed: bool
    accepted: dict[str, float] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)
    healed: dict[str, str | None] = field(default_factory=dict)
    error: str | None = None
    view: HubView | None = None

    def header(self, name: str) -> ResultHeader:
        """Member ``name``'s status in the round (accepted, rejected, healed) and why, with θ_global's frames."""
        if self.error is not None:  # nothing changed: the member trains on, as after a round it missed
            status, reason = "missed", self.error
        elif name in self.accepted:
            status, reason = "accepted", None
        elif name in self.rejected:
            status, reason = "rejected", self.rejected[name]
        else:
            status, reason = "healed", self.healed.get(name)
        return ResultHeader(status, reason, **vars(self.view), committed=self.committed, accepted=self.accepted,
                            rejected=self.rejected)  # fmt: skip


@dataclass
class Round:
    rid: int  # this hub's round number (across versions: a round that commits nothing keeps the version)
    version: int
    opened: float
    arrivals: dict[str, Arrival] = field(default_factory=dict)
    state: RoundState = RoundState.OPEN
    outcome: Outcome | None = None
    fp32: bool = False  # its uploads are fp32 parameters although the federation compresses (spec.final_in_fp32)

    def move(self, to: RoundState) -> None:
        self.state = _move(f"round {self.rid}", ROUND_MOVES, self.state, to)
