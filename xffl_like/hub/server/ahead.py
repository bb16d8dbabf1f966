"""A round's next version computed while its uploads stream in, so that little is left once the last one ends.

Without it, a round's commit starts when the round closes, after the last upload's last byte: every accepted
upload is read back from its spool file, folded with the saved version (:mod:`.fold`) and the next version
written and made durable (:mod:`.store`), and only then does the first byte of the result go out. Folding
ahead moves all but the last window of that work under the uploads: once every live member has arrived with
an fp32 upload wanted, the hub's committer begins the next version's file (:meth:`.store.StateStore.begin`)
and, as the uploads are spooled (each :class:`.rounds.Arrival` counts its bytes on disk, ``received``), folds
each window that every upload has reached, with the saved version's, into it. When the round closes only the
windows of the last frames remain, then the header, the fsync and the rename.

It computes exactly what the commit at the close would (:func:`.fold.next_window`, the same windows, the
same plan): the accepted uploads in name order, their scales each one's weight over their sum, the weighted
mean summed in name order from zero, or a robust rule (``median``, ``trimmed_mean``: every upload's window is
there when it is folded, so these rules fold ahead as well), then the outer step; bitwise the same version,
whatever the order in which the uploads arrive. It is a guess made before the round is judged, so it is used
only if the round decides what it assumed (:attr:`Ahead.key`: the round, the accepted members in order,
their scales) and the version's header fits its room (:data:`.store.SLACK`). Otherwise (an upload rejected
by the checks, broken off or cut at ``grace_s``, a member that arrived meanwhile) the file is removed
unfinished and the round commits from the spool files as without it: a rejected upload folded ahead leaves
no trace, nothing of the unfinished file is ever a version, and a hub killed meanwhile restarts from the
saved one (the temporary file is removed by the next save).

Compressed rounds (top-k and the other codecs) do not fold ahead: their messages are small, and what their
commit spends (the outer step over the whole model, writing it) cannot start before every message is in. They
commit by a record instead (:mod:`.journal`), their members hear at once, and the version's file is written
behind it. A round of fp32 parameters in a compressed federation (eager's final round, :attr:`.rounds.Round.fp32`)
folds ahead as any fp32 round does.
"""

from __future__ import annotations

import torch

from ..protocol.relay import Reader
from .checks import squares
from .fold import Plan, next_window
from .rounds import Arrival
from .store import Pending, Snapshot

__all__ = ["Ahead"]


class Ahead:
    """Round ``key[0]``'s next version, folded into ``pending`` as the uploads of ``arrivals`` (in name order,
    ``key[1]``) are spooled; ``key``: what the round must decide for it to be used. ``n``: values per window."""

    def __init__(self, key: tuple, pending: Pending, plan: Plan, saved: Snapshot, arrivals: list[Arrival], n: int):
        self.key, self.pending, self.plan, self.saved, self.arrivals = key, pending, plan, saved, arrivals
        self.numel = saved.theta.numel()
        self.n, self.start, self.squares = n, 0, 0.0
        self.stack = torch.empty(len(arrivals), n, dtype=torch.float32)
        self.readers: list | None = None

    @property
    def done(self) -> bool:
        return self.start >= self.numel

    def advance(self) -> int:
        """Fold each next window that every upload has spooled; the windows folded."""
        folded = 0
        while not self.done:
            k = min(self.n, self.numel - self.start)
            if any(a.received < 4 * (self.start + k) for a in self.arrivals):
                break
            if self.readers is None:
                self.readers = []  # each one closed with the others, even if a later one cannot be opened
                for a in self.arrivals:
                    self.readers.append(Reader(a.spool, None))
            theta, buffers = next_window(self.plan, self.saved, self.readers, self.start, self.stack[:, :k])
            self.squares += squares(theta.numpy(), None, 0)
            for name, values in {"theta": theta, **buffers}.items():
                self.pending.put(name, values)
            self.start, folded = self.start + k, folded + 1
        return folded

    def finish(self, snap: Snapshot) -> None:
        """The round decided what this assumed, every upload spooled: the last windows, then ``snap`` saved."""
        self.advance()
        if not self.done:
            raise ValueError(f"an accepted upload's spool file ends before value {self.start + self.n}")
        self._close()
        self.pending.finish(snap)

    def abort(self) -> None:
        """Remove the unfinished file: nothing of it is kept."""
        self._close()
        self.pending.abort()

    def _close(self) -> None:
        for reader in self.readers or ():
            reader.close()
        self.readers = []
