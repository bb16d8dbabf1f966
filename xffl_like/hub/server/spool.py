"""The spool: each upload written to its own file as it arrives, measured on the way, read back to average.

A contribution is never held whole in memory: its frames go to ``<state>/spool/<round>-<facility>.bin``
while the hub sums the squares of its update ``θ_global - θ_f`` (fp32 parameters) or decodes it (a
compressed update, :mod:`..protocol.update_codec`); at the commit each accepted file is read back a window
at a time (:class:`.aggregate.Reader`, :mod:`.fold`). No file outlives its round: a broken upload's is
removed at once, and every file of a decided round (accepted, rejected or late) is removed with it
(:meth:`Spool.clear`). A spool that is a symbolic link is refused, and no file in it is followed.
"""

from __future__ import annotations

import math
import os
import shutil
import zlib
from pathlib import Path

import numpy as np
from torch import Tensor

from ..protocol.update_codec import UpdateCodec
from ..protocol.wire import Frames, WireError
from .checks import SLICE, squares
from .store import StateError

__all__ = ["Spool"]


class Spool:
    """The spool directory ``directory`` (emptied at start)."""

    def __init__(self, directory: Path):
        self.dir = directory
        if directory.is_symlink():
            raise StateError(
                f"{directory} is a symbolic link: the hub follows none in its --state directory; remove it (the "
                f"hub makes its spool there itself)"
            )
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)

    def path(self, rid: int, name: str) -> Path:
        return self.dir / f"{rid}-{name}.bin"

    def clear(self, rid: int) -> None:
        """Remove every file of round ``rid``."""
        for p in self.dir.glob(f"{rid}-*.bin"):
            p.unlink(missing_ok=True)

    @staticmethod
    def _create(path: Path):
        path.unlink(missing_ok=True)
        return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb")

    def receive(self, frames: Frames, path: Path) -> None:
        """Write the chunks to ``path`` as they come, unmeasured (a creator's parameters: :meth:`norm` after)."""
        with self._create(path) as fh:
            for _, chunk in frames.chunks():
                fh.write(chunk)

    @staticmethod
    def norm(path: Path) -> float:
        """The norm of the fp32 values in ``path``, read a slice at a time (nan when one is not finite)."""
        total = 0.0
        with open(path, "rb") as fh:
            while math.isfinite(total) and (raw := fh.read(4 * SLICE)):
                total += squares(np.frombuffer(raw, dtype=np.float32), None, 0)
        return math.sqrt(total) if math.isfinite(total) else math.nan

    def write(self, frames: Frames, path: Path, theta: Tensor | None, codec: UpdateCodec | None, written=None,
              ended=None) -> tuple[float, str | None]:  # fmt: skip
        """Write the chunks to ``path``; the norm of the update ``θ_global - θ_f`` (nan when not finite) and, for a
        message (``codec``), its CRC-32, the file fsynced (a round's record names it: :mod:`.journal`).
        ``written(n)``: fp32 parameters, after each chunk, the first ``n`` bytes are in the file (readable);
        ``ended()``: its last byte is in the file (a message is decoded as its frames come, so its norm is known
        then too)."""
        if codec is not None:
            with self._create(path) as fh:
                tee = _Tee(frames.chunks(), fh)
                norm = _update_norm(codec, tee.read)  # decoded as the frames come: done with the last one
                tee.drain()
                if ended is not None:
                    ended()
                fh.flush()
                os.fsync(fh.fileno())
            return norm, f"{tee.crc:08x}"
        total = 0.0
        with self._create(path) as fh:
            for offset, chunk in frames.chunks():
                if offset % 4 or len(chunk) % 4:
                    raise WireError("a frame that splits a value")
                fh.write(chunk)
                if written is not None:
                    fh.flush()
                    written(offset + len(chunk))
                if math.isfinite(total):  # read in place: the frame is never copied
                    total += squares(np.frombuffer(chunk, dtype=np.float32), theta, offset // 4)
        if ended is not None:
            ended()
        return (math.sqrt(total) if math.isfinite(total) else math.nan), None


def _update_norm(codec: UpdateCodec, read) -> float:
    """The norm of the update a message decodes to, from ``read(n)`` (nan when a value is not finite)."""
    total = 0.0
    pieces = (p[-1] for p in codec.decode_sent_stream(read)) if codec.senders else (
        p[1] for p in codec.decode_stream(read))  # fmt: skip
    for values in pieces:  # top-k: the values sent only (the others are 0)
        total += squares(values.numpy(), None, 0)
    return math.sqrt(total) if math.isfinite(total) else math.nan


class _Tee:
    """An upload's chunks as ``read(n)``: each chunk written to ``fh``, and its CRC-32 taken, as it is pulled."""

    def __init__(self, chunks, fh):
        self.chunks, self.fh, self.crc, self.buf = chunks, fh, 0, bytearray()

    def _pull(self) -> bool:
        chunk = next(self.chunks, None)
        if chunk is None:
            return False
        self.fh.write(chunk[1])
        self.crc = zlib.crc32(chunk[1], self.crc)
        self.buf += chunk[1]
        return True

    def read(self, n: int) -> bytes:
        while len(self.buf) < n and self._pull():
            pass
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def drain(self) -> None:
        """The rest of the upload, written (the frames' own checks run to their end)."""
        while self._pull():
            self.buf.clear()
