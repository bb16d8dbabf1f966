"""The checkpoint directory on disk: names, the ``latest`` pointer, completeness, safe reading.

A checkpoint is a directory ``<checkpoint.dir>/step-<8 digits>/`` holding DCP's files
(``.metadata`` and one ``__<rank>_<n>.distcp`` per writing rank) and ``state.json`` (the
counters, records and other small values, written by rank 0). It is written as
``.tmp-step-<N>`` and becomes visible by one rename once every rank's part is complete;
``latest`` (a one-line text file, replaced atomically) names the newest complete one.

Nothing read here executes code: ``state.json`` is JSON, and DCP's ``.metadata`` pickle goes through
:mod:`.safe`'s reader, whose unpickler admits only DCP's metadata classes.
Pure file-system code: no torch import (the launcher checks a resume with it before any worker starts, and
importing ``torch.distributed.checkpoint`` there cost about 0.7 s of CPU per launch). Reading DCP's files is
:mod:`.safe`.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config.schema import CheckpointConfig

__all__ = [
    "LATEST",
    "STATE_FILE",
    "Damaged",
    "checkpoint_dir",
    "checkpoint_name",
    "check_intact",
    "is_complete",
    "latest_checkpoint",
    "list_checkpoints",
    "newest_intact",
    "publish",
    "read_state",
    "remove_stale",
    "retain",
]

LATEST = "latest"
STATE_FILE = "state.json"
_PREFIX = "step-"
_TMP = ".tmp-"


def checkpoint_dir(checkpoint: CheckpointConfig, run_dir: Path) -> Path:
    """``checkpoint.dir`` of the ``checkpoint`` section, or ``<run_dir>/checkpoints`` when it is null."""
    configured = checkpoint.dir
    return Path(configured).expanduser().absolute() if configured else Path(run_dir) / "checkpoints"


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint taken after ``step`` optimizer steps."""
    return f"{_PREFIX}{step:08d}"


def is_complete(path: Path) -> bool:
    """A published checkpoint: DCP's metadata and our ``state.json`` are both there."""
    return (path / ".metadata").is_file() and (path / STATE_FILE).is_file()


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Published checkpoints of ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    return sorted(p for p in ckpt_dir.iterdir() if p.name.startswith(_PREFIX) and p.is_dir())


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or ``None`` when there is none (or it is incomplete)."""
    pointer = Path(ckpt_dir) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = Path(ckpt_dir) / name
    return path if name.startswith(_PREFIX) and is_complete(path) else None


class Damaged(ValueError):
    """A published checkpoint that cannot be resumed from: ``file`` (a path) and ``cause`` (a few words)."""

    def __init__(self, file: Path, cause: str):
        super().__init__(f"{file}: {cause}")
        self.file, self.cause = Path(file), cause


# What torch.save (hence every DCP item) starts with: a zip local-file header.
_ZIP_MAGIC = b"PK\x03\x04"


def check_intact(path: Path) -> None:
    """Raise :class:`Damaged` (naming the file and the cause) unless checkpoint ``path`` can be read back:
    ``.metadata`` exists and parses, ``state.json`` parses, every file the metadata names exists, is long
    enough and holds a ``torch.save`` record at each item's offset. Reads a few bytes per item, no tensor."""
    from .safe import SafeFileSystemReader

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise Damaged(path / ".metadata", "missing .metadata")
    try:
        metadata = SafeFileSystemReader(str(path)).read_metadata()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError, IndexError) as exc:
        raise Damaged(path / ".metadata", f"not DCP metadata ({type(exc).__name__}: {exc})") from None
    if not (path / STATE_FILE).is_file():
        raise Damaged(path / STATE_FILE, f"missing {STATE_FILE}")
    try:
        json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise Damaged(path / STATE_FILE, f"not JSON ({type(exc).__name__})") from None
    items: dict[str, list[tuple[int, int]]] = {}
    for info in (metadata.storage_data or {}).values():
        items.setdefault(info.relative_path, []).append((info.offset, info.length))
    for name, spans in sorted(items.items()):
        file = path / name
        if not file.is_file():
            raise Damaged(file, "missing shard file (named by .metadata)")
        size, needed = file.stat().st_size, max(o + n for o, n in spans)
        try:
            with open(file, "rb") as fh:
                for offset, _ in spans:
                    fh.seek(offset)
                    head = fh.read(len(_ZIP_MAGIC))
                    if head and head != _ZIP_MAGIC:  # nothing there: past the end, reported as truncated below
                        raise Damaged(file, f"not a DCP shard (no tensor record at byte {offset})")
        except OSError as exc:
            raise Damaged(file, exc.strerror or str(exc)) from None
        if size < needed:
            raise Damaged(file, f"truncated ({size} of {needed} bytes)")


def newest_intact(ckpt_dir: Path, before: Path | None = None) -> Path | None:
    """The newest published checkpoint of ``ckpt_dir`` that :func:`check_intact` accepts (older than
    ``before`` when given), or ``None``."""
    for path in reversed(list_checkpoints(Path(ckpt_dir))):
        if before is not None and path.name >= Path(before).name:
            continue
        try:
            check_intact(path)
            return path
        except Damaged:
            continue
    return None


def read_state(path: Path) -> dict:
    """The ``state.json`` of a checkpoint (``ValueError`` if unreadable)."""
    try:
        return json.loads((Path(path) / STATE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{Path(path) / STATE_FILE} cannot be read ({type(exc).__name__}: {exc})") from None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{_TMP}{path.name}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def publish(tmp: Path, final: Path, state: dict) -> None:
    """Rank 0, after every rank's part of ``tmp`` is written: add ``state.json``, rename
    ``tmp`` to ``final`` (one rename), then move ``latest`` to it."""
    _write_atomic(tmp / STATE_FILE, json.dumps(state, indent=1))
    if final.exists():  # the same step saved again after a restart: the new one wins
        old = final.with_name(f"{_TMP}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, final)
    _write_atomic(final.parent / LATEST, final.name + "\n")


def retain(ckpt_dir: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` published checkpoints (never the one ``latest``
    names); return the deleted paths."""
    latest = latest_checkpoint(ckpt_dir)
    done = list_checkpoints(ckpt_dir)
    gone = [p for p in done[:-keep] if p != latest] if keep < len(done) else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def remove_stale(ckpt_dir: Path) -> None:
    """Remove partial checkpoints left by a job that died while writing (rank 0, at start)."""
    if ckpt_dir.is_dir():
        for path in ckpt_dir.iterdir():
            if path.name.startswith(_TMP):
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
