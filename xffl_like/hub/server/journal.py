"""A compressed round's commit point: a small durable record of what it decided, before θ_global's next file.

With compression, a round's next version is a function of the saved version and the round's accepted messages
alone (:func:`..protocol.relay.rounds`, which every facility applies too). So a round commits once its record is
durable (:func:`write`): the accepted messages, moved from the spool into ``<state>/journal/`` (each one fsynced
when it was spooled, its CRC-32 taken on the way in), and one JSON file naming them with their CRC-32s and sizes,
the fold order and the weights, the base version and the next version's description (its progress, its members'
history): written aside, fsynced, renamed, the directory fsynced. Its members then hear at once and apply the
relay themselves, while the hub writes the version's file behind it (:mod:`.federation`); once that file is
durable the record is removed (:meth:`Record.done`), its messages kept as the relay until the next round commits.

A hub killed in between replays the record when it starts (:func:`read`: every claim checked, every message's
CRC), writing the same file bitwise, so a member that applied the relay and the hub agree; a record whose
version the hub already holds is removed. Bytes written and fsynced per compressed round, before its members
hear: the accepted messages (``F x`` a message; already on disk, only renamed) and the record (a few KB, the
members' history most of it); then the version's file as without it (:mod:`.store`).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

from .store import Snapshot, StateError, described, fsync_dir, snapshot_of

__all__ = ["Record", "clear", "crc_of", "read", "write"]

_FORMAT = "xffl-hub-journal-1"
_RECORD = re.compile(r"^(\d{10})\.json$")
_FIX = "remove it to keep the saved version (members that applied the round heal to it), or start with --fresh"


@dataclass(frozen=True)
class Record:
    """Round ``rid``'s record (``path``): ``base`` became ``snap`` (its description: no tensors) with the
    messages ``paths``, weighted ``scales`` (both in fold order)."""

    path: Path
    rid: int
    base: int
    snap: Snapshot
    scales: dict[str, float]
    paths: dict[str, Path]

    @property
    def version(self) -> int:
        return self.snap.version

    def done(self) -> None:
        """The version's file is durable: the record goes (its messages stay, for the relay)."""
        self.path.unlink(missing_ok=True)

    def remove(self) -> None:
        """The record and its messages go."""
        self.done()
        for p in self.paths.values():
            p.unlink(missing_ok=True)


def crc_of(path: Path) -> str:
    """A file's CRC-32 (eight hex digits)."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _directory(directory: Path) -> Path:
    if directory.is_symlink():
        raise StateError(f"{directory} is a symbolic link: the hub follows none in its --state directory; remove it")
    directory.mkdir(exist_ok=True)
    return directory


def write(directory: Path, snap: Snapshot, rid: int, base: int, scales: dict[str, float],
          spooled: dict[str, tuple[Path, str]]) -> Record:  # fmt: skip
    """Round ``rid``'s record, durable: ``base`` becomes ``snap`` with the messages ``spooled`` (each a file,
    fsynced, and its CRC-32), weighted ``scales`` (fold order). The files are moved into ``directory``."""
    directory = _directory(directory)
    paths, sums, sizes = {}, [], []
    for name in scales:
        path, crc = spooled[name]
        paths[name] = directory / f"{snap.version:010d}-{name}.bin"
        os.replace(path, paths[name])
        sums.append(crc)
        sizes.append(paths[name].stat().st_size)
    fsync_dir(directory)  # the messages are where the record names them before the record exists
    text = json.dumps({"format": _FORMAT, "rid": rid, "base": base, "order": list(scales), "scales": list(
        scales.values()), "sizes": sizes, "crc32": sums, "state": described(snap)})  # fmt: skip
    final = directory / f"{snap.version:010d}.json"
    tmp = directory / f".{final.name}.tmp"
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, json.dumps({"record": text, "crc32": f"{zlib.crc32(text.encode()):08x}"}).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, final)
    fsync_dir(directory)
    return Record(final, rid, base, snap, dict(scales), paths)


def read(directory: Path, message_bytes: int) -> list[Record]:
    """The records in ``directory``, oldest first, each checked: its own checksum, its claims, and every message
    (present, ``message_bytes`` long, its CRC-32); :class:`StateError` (one line naming the file and the fix)."""
    if not directory.exists():
        return []
    _directory(directory)
    for tmp in directory.glob(".*.tmp"):  # a record never renamed: its round was never heard of
        tmp.unlink()
    found = sorted((p for p in directory.iterdir() if _RECORD.match(p.name)), key=lambda p: p.name)
    return [_record(p, message_bytes) for p in found]


def _record(path: Path, message_bytes: int) -> Record:
    try:
        outer = json.loads(path.read_bytes())
        text = outer["record"]
        if outer["crc32"] != f"{zlib.crc32(text.encode()):08x}":
            raise ValueError("its checksum does not match")
        body = json.loads(text)
        if body["format"] != _FORMAT:
            raise ValueError(f"format {body['format']!r}, not {_FORMAT}")
        snap = snapshot_of(body["state"])
        order, scales, sizes, sums = body["order"], body["scales"], body["sizes"], body["crc32"]
        if not (len(order) == len(set(order)) == len(scales) == len(sizes) == len(sums) > 0):
            raise ValueError("its members, weights, sizes and checksums do not match")
        if snap.version != int(body["base"]) + 1 or f"{snap.version:010d}.json" != path.name:
            raise ValueError("its versions do not match its name")
        if any(type(s) is not float or not 0.0 < s <= 1.0 for s in scales):
            raise ValueError("a weight is not in (0, 1]")
    except (OSError, ValueError, KeyError, TypeError, OverflowError, UnicodeDecodeError) as exc:
        raise StateError(f"{path} is damaged ({str(exc)[:120]}): {_FIX}") from None
    paths = {name: path.with_name(f"{snap.version:010d}-{name}.bin") for name in order}
    for (name, p), size, crc in zip(paths.items(), sizes, sums, strict=True):
        if p.is_symlink() or not p.is_file() or p.stat().st_size != size or size != message_bytes or crc_of(p) != crc:
            raise StateError(f"{path}: facility {name}'s message {p.name} is missing or damaged: {_FIX}")
    return Record(path, int(body["rid"]), int(body["base"]), snap, dict(zip(order, scales, strict=True)), paths)


def clear(directory: Path) -> None:
    """Remove every file left in ``directory`` (after the records were replayed: no message is relayed once the hub
    restarted)."""
    if directory.exists():
        for p in _directory(directory).iterdir():
            p.unlink()
