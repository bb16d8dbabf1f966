"""What a compressed round leaves at the hub for its members to download: the relay (:mod:`..protocol.relay`).

Once a compressed round is committed by its record (:mod:`.journal`), each member accepted in it reads a header and
the other accepted members' messages, and applies the round itself, at once: the relay needs no file of θ_global,
which the hub writes behind the record meanwhile. The hub keeps the messages of its last committed round only (the
record's files, ``journal/<version>-<facility>.bin``), removed when the next round commits or the hub restarts. It
relays them only while that round's version is the hub's latest; any other member (rejected, healed, behind a newer
commit) reads θ_global in full, once its file is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..protocol.messages import Relay

__all__ = ["Relayed"]


@dataclass(frozen=True)
class Relayed:
    """Round ``rid``'s accepted messages (``paths``, in the hub's fold order) that made ``version`` from ``base``."""

    rid: int
    base: int
    version: int
    weights: dict[str, float]  # in fold order, as the hub used them
    paths: dict[str, Path]
    outer_steps: int

    def header(self, name: str) -> Relay:
        """The relay header for member ``name`` (its own message is not sent)."""
        sizes = tuple(0 if n == name else p.stat().st_size for n, p in self.paths.items())
        return Relay(self.base, tuple(self.paths), tuple(self.weights.values()), sizes, self.outer_steps)

    def open(self, name: str) -> list[tuple[BinaryIO, int]]:
        """The other members' messages, each an open file and its bytes (they stay readable once removed)."""
        opened = []
        try:
            for n, p in self.paths.items():
                if n != name:
                    fh = os.fdopen(os.open(p, os.O_RDONLY | os.O_NOFOLLOW), "rb")
                    opened.append((fh, os.fstat(fh.fileno()).st_size))
        except OSError:
            for fh, _ in opened:
                fh.close()
            raise
        return opened

    def remove(self) -> None:
        for p in self.paths.values():
            p.unlink(missing_ok=True)
