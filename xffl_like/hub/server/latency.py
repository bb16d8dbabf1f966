"""How long a round's members wait on the hub itself: from the end of the round's last upload (its last byte in
the spool file) to the first byte of its result going out (the check, the mean, the outer step and the save in
between; with fp32 uploads most of the mean, the step and the save are done while the uploads stream in,
:mod:`.ahead`; a compressed round is saved by its record, the version's file written after, :mod:`.journal`), one
log line per committed round::

    hub: round 3 (version 4): 0.412 s from the last upload's end to the first byte of its result (round 9.87 s)

The round's time there runs from its opening (the first arrival) to that first byte. The latency includes any
wait for the round to close after its last upload (a live member that has not arrived keeps it open, up to
``grace_s``). ``bench.mode=hub``
reads these lines into its table (:mod:`xffl_like.bench.hub_rounds`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

__all__ = ["LINE", "ResultLatency"]

#: The log line, formatted with rid, version, the seconds from the last upload's end and the round's seconds.
LINE = (
    "hub: round {} (version {}): {:.3f} s from the last upload's end to the first byte of its result (round {:.2f} s)"
)
_KEEP = 64  # rounds remembered (a result is read within a few rounds of its commit, or not at all)


class ResultLatency:
    """Stamps, per round id, the end of its last upload, and logs once when the first byte of its result goes
    out. Thread-safe (uploads and result streams run on the server's pool)."""

    def __init__(self, log):
        self.log = log
        self._ended: dict[int, float] = {}
        self._logged: set[int] = set()
        self._lock = threading.Lock()

    def upload_ended(self, rid: int) -> None:
        """An upload of round ``rid`` has ended (uploaded in full)."""
        with self._lock:
            self._ended[rid] = time.monotonic()
            for old in [k for k in self._ended if k < rid - _KEEP]:
                del self._ended[old]
            self._logged = {k for k in self._logged if k >= rid - _KEEP}

    def first_byte(self, rid: int, version: int, opened: float, frames: Iterator[bytes]) -> Iterator[bytes]:
        """``frames`` (round ``rid``'s result, committing ``version``; the round opened at ``opened``,
        monotonic), the moment its first frame is handed out logged if it is the round's first."""
        try:
            for i, frame in enumerate(frames):
                if i == 0:
                    self._first(rid, version, opened)
                yield frame
        finally:
            close = getattr(frames, "close", None)
            if close is not None:
                close()  # the stream's own cleanup (its file, its deadline) now, not when collected

    def _first(self, rid: int, version: int, opened: float) -> None:
        now = time.monotonic()
        with self._lock:
            ended = self._ended.get(rid)
            if ended is None or rid in self._logged:
                return
            self._logged.add(rid)
        self.log(LINE.format(rid, version, now - ended, now - opened))
