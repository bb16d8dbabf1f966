"""A round's record: :class:`RoundRecord`, what every kind of round returns to the trainer.

The federations build them (a whole-model round, a fragment's, a delayed one, a phase switch, an elastic
facility's round through the hub); the trainer keeps them, the observer (``metrics.jsonl``,
``aggregation.csv``, W&B, plots) and the summary read them, and a checkpoint's ``state.json`` holds them as
plain dicts (:meth:`RoundRecord.to_dict`, :meth:`RoundRecord.from_dict`: the same keys, in the same order).

A key that a kind of round does not have is :data:`UNSET` (not ``None``, which some kinds record as a
value: ``steps_taken`` where every facility takes the same steps), and is left out of the dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

__all__ = ["UNSET", "RoundRecord"]


class _Unset:
    """The value of a key that a kind of round does not have."""

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:
        return False


UNSET: Any = _Unset()


@dataclass
class RoundRecord:
    """One round (or a phase switch, or a fragment's sync), in the order of its keys in the files."""

    round: int | None  # its index among the job's rounds (None: an elastic join that only healed)
    step: int  # this facility's steps when it was applied
    fragment: int | None = None  # streaming: the fragment synced; None: the whole model
    switch: bool = UNSET  # a phase switch's average (federation.schedule)
    started_step: int = UNSET  # streaming: the step its exchange started at
    steps_taken: list[int] | None = UNSET  # each facility's steps in the round (None: the same for all)
    landed: list[int] = UNSET  # federation.delay=1: the steps of the rounds whose outer step landed here
    seconds: float = 0.0  # how long it held this rank up (after the job: the slowest rank's)
    exchange_seconds: float = UNSET  # streaming, delayed: how long the exchange itself ran
    bytes_per_rank: int = 0  # what this rank sent
    cross_facility_bytes: int = 0  # what crossed facilities, summed over the world
    skipped_facilities: list[int] = field(default_factory=list)  # left out (the non-finite guard)
    facilities: list = UNSET  # elastic (the leader): the hub's members of the round
    healed: list = UNSET  # elastic: the members that received θ_global without contributing
    attempts: int = UNSET  # elastic: the tries it took
    status: str | None = UNSET  # elastic: what the hub made of this facility's update
    reason: str | None = UNSET  # elastic: why it was rejected, healed or missed
    rejected: list = UNSET  # elastic: the members whose contributions the hub rejected
    bytes_up: int = UNSET  # elastic (the leader): the bytes it sent the hub in the round (headers included)
    bytes_down: int = UNSET  # elastic (the leader): the bytes it received from the hub in the round
    phase: int = UNSET  # federation.schedule: the phase it ended
    waited: float = UNSET  # this rank's wait for the other facilities before it (until the job's end)
    waited_s: list[float] = UNSET  # each facility's wait at it (the slowest rank's), after the job
    extra: dict = field(default_factory=dict)  # keys of a checkpoint this version does not know, kept

    def has(self, name: str) -> bool:
        """Whether this kind of round has the key ``name``."""
        return getattr(self, name, UNSET) is not UNSET or name in self.extra

    def get(self, name: str, default: Any = None) -> Any:
        """The value of ``name``, or ``default`` where this kind of round has no such key."""
        value = getattr(self, name, UNSET) if name != "extra" else UNSET
        if value is UNSET:
            return self.extra.get(name, default)
        return value

    def to_dict(self) -> dict:
        """The plain dict of the files and checkpoints: the keys this kind has, in order."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        return {**{k: v for k, v in out.items() if v is not UNSET}, **self.extra}

    @classmethod
    def from_dict(cls, d: dict) -> RoundRecord:
        """A record from :meth:`to_dict`'s dict (a checkpoint's ``state.json``)."""
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in d.items() if k in known}, extra={k: v for k, v in d.items() if k not in known})
