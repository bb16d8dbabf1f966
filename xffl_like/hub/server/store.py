"""The hub's durable state, behind one interface (:class:`StateStore`: open, save).

Its implementation, :class:`SafetensorsStore`: after every committed round, one safetensors file holding
θ_global, the outer optimizer's buffers and, in its metadata, the version, the federation's description
and its members; written atomically (temporary file, fsync, rename, fsync of the directory), the
last two kept. The tensors carry a CRC-32 each and the metadata (which holds them) one of its own, so a
damaged file is found, never trained on; on load θ_global and the buffers must have the sizes the
federation's description gives. Nothing in ``--state`` is a symbolic link (none is followed), and one hub
at a time holds it (an exclusive lock on ``hub.lock``, for the hub's life).
"""

from __future__ import annotations

import abc
import fcntl
import json
import os
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from ..protocol.spec import SpecError, numel_of

__all__ = ["KEEP", "SafetensorsStore", "Snapshot", "StateError", "StateStore", "load_latest", "save"]

KEEP = 2
_NAME = re.compile(r"^state-(\d{10})\.safetensors$")
_FORMAT = "xffl-hub-2"  # the metadata checksummed too ("xffl-hub-1": tensors only, still read)
_FORMATS = ("xffl-hub-1", _FORMAT)
LOCK = "hub.lock"


class StateError(RuntimeError):
    """The hub's state directory cannot be used (one line naming the file and the fix)."""


@dataclass
class Snapshot:
    """What the hub keeps across restarts."""

    version: int  # rounds committed
    spec: dict[str, Any]  # the federation's description (the first facility's)
    theta: Tensor  # θ_global, flat fp32
    buffers: dict[str, Tensor] = field(default_factory=dict)  # the outer optimizer's state
    outer_steps: int = 0
    progress: int = 0  # rounds of training behind θ_global (a joiner's step: progress x its every)
    ended: bool = False  # federation.every_s: a member reached train.steps
    members: dict[str, dict[str, Any]] = field(default_factory=dict)  # per facility: last step, recent norms
    federation: str = ""  # its id, drawn at creation: members notice a hub that holds another federation


def _crc(t: Tensor) -> str:
    raw = t.contiguous().view(-1).view(torch.uint8).numpy()
    crc = 0
    for start in range(0, raw.size, 64 << 20):
        crc = zlib.crc32(memoryview(raw[start : start + (64 << 20)]), crc)
    return f"{crc:08x}"


def _write_safetensors(fh, tensors: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """The safetensors format (an 8-byte little-endian header length, the JSON header, then each tensor's
    bytes), written tensor by tensor from the tensors' own memory: ``safetensors.torch.save_file`` would
    first copy every tensor (the whole state twice in memory). Read back with ``safetensors.safe_open``."""
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"{name}: the hub saves contiguous fp32 tensors")
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    fh.write(len(text).to_bytes(8, "little"))
    fh.write(text)
    for t in tensors.values():
        raw = t.view(-1).view(torch.uint8).numpy()
        for start in range(0, raw.size, 64 << 20):
            fh.write(memoryview(raw[start : start + (64 << 20)]))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: Path, snap: Snapshot) -> Path:
    """Write ``snap`` as ``state-<version>.safetensors`` atomically; keep the last :data:`KEEP`."""
    tensors = {"theta": snap.theta, **{f"outer.{k}": v for k, v in snap.buffers.items()}}
    meta = {
        "format": _FORMAT,
        "version": snap.version,
        "spec": snap.spec,
        "outer_steps": snap.outer_steps,
        "progress": snap.progress,
        "ended": snap.ended,
        "members": snap.members,
        "federation": snap.federation,
        "crc32": {k: _crc(v) for k, v in tensors.items()},
    }
    final = directory / f"state-{snap.version:010d}.safetensors"
    tmp = directory / f".{final.name}.tmp"
    text = json.dumps(meta)
    tmp.unlink(missing_ok=True)  # a crash's leftover (a link is removed, never followed)
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "wb") as fh:
            _write_safetensors(fh, tensors, {"xffl": text, "xffl_crc32": f"{zlib.crc32(text.encode()):08x}"})
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(directory)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk keeps no partial file
        raise
    for old in _files(directory)[KEEP:]:
        old.unlink(missing_ok=True)
    return final


def _files(directory: Path) -> list[Path]:
    """The state files, newest first."""
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    for p in found:
        _no_link(p)
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def _no_link(path: Path) -> None:
    """``path`` must not be a symbolic link: the hub follows none in its state directory."""
    if path.is_symlink():
        raise StateError(
            f"{path} is a symbolic link: the hub follows none in its --state directory; replace it with the "
            f"file or directory itself (or remove it)"
        )


_FIX = "remove it to fall back to the previous round's file, or start the hub with --fresh (a new federation)"


def _metadata(path: Path, fh) -> dict:
    """The file's metadata, its checksum checked (``xffl-hub-2``)."""
    raw = fh.metadata() or {}
    text = raw.get("xffl", "null")
    meta = json.loads(text)
    if not isinstance(meta, dict) or meta.get("format") not in _FORMATS:
        raise StateError(f"{path} is not a hub state file ({_FORMAT}): {_FIX}")
    if meta["format"] == _FORMAT and raw.get("xffl_crc32") != f"{zlib.crc32(text.encode()):08x}":
        raise StateError(f"{path} is damaged (the checksum of its metadata does not match): {_FIX}")
    return meta


def _read(path: Path) -> Snapshot:
    _no_link(path)
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = _metadata(path, fh)
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open has no iteration
    except (SafetensorError, OSError, ValueError, OverflowError) as exc:
        raise StateError(f"{path} is damaged or unreadable ({str(exc).splitlines()[0][:120]}): {_FIX}") from None
    sums = meta.get("crc32", {})
    if not isinstance(sums, dict) or set(sums) != set(tensors) or any(_crc(t) != sums[k] for k, t in tensors.items()):
        raise StateError(f"{path} is damaged (a checksum does not match): {_FIX}")
    try:
        snap = Snapshot(
            version=int(meta["version"]),
            spec=dict(meta["spec"]),
            theta=tensors.pop("theta"),
            buffers={k.removeprefix("outer."): v for k, v in tensors.items()},
            outer_steps=int(meta["outer_steps"]),
            progress=int(meta["progress"]),
            ended=bool(meta["ended"]),
            members=dict(meta["members"]),
            federation=str(meta.get("federation", "")),
        )
        _check_sizes(snap)
    except KeyError as exc:
        raise StateError(f"{path} lacks {exc} (not written by this hub, or edited): {_FIX}") from None
    except (TypeError, ValueError, OverflowError, SpecError) as exc:
        raise StateError(f"{path} holds a value this hub cannot use ({str(exc)[:120]}): {_FIX}") from None
    return snap


def _check_sizes(snap: Snapshot) -> None:
    """θ_global and each buffer: flat, of the size the federation's description gives (ValueError)."""
    n = numel_of(snap.spec)
    for name, t in {"theta": snap.theta, **snap.buffers}.items():
        if t.dim() != 1 or t.numel() != n:
            raise ValueError(f"{name} has shape {list(t.shape)}, the federation's description gives [{n}]")


def load_latest(directory: Path) -> Snapshot | None:
    """The newest saved state, None when there is none; :class:`StateError` when it is damaged."""
    files = _files(directory)
    if not files:
        return None
    return _read(files[0])


class StateStore(abc.ABC):
    """Where the hub keeps its federation across restarts."""

    @abc.abstractmethod
    def open(self, fresh: bool) -> Snapshot | None:
        """The saved federation (None: a new one; ``fresh``: set the old one aside); :class:`StateError`."""

    @abc.abstractmethod
    def save(self, snap: Snapshot) -> None:
        """Keep ``snap`` durably before any member hears of it (raises, changing nothing kept, when it cannot)."""

    @abc.abstractmethod
    def load(self, version: int) -> Snapshot:
        """The saved ``version`` (:class:`StateError` when it is gone or damaged)."""

    @abc.abstractmethod
    def theta_reader(self, version: int) -> tuple[BinaryIO, int]:
        """θ_global of the saved ``version``: an open file at its first byte and its bytes. The version stays
        readable through it whatever is saved meanwhile (readers never hold a commit)."""

    def tensor_reader(self, version: int, name: str) -> tuple[BinaryIO, int]:
        """As :meth:`theta_reader`, for the saved tensor ``name`` (``theta``, or ``outer.<buffer>``)."""
        raise NotImplementedError(f"{type(self).__name__} reads θ_global only")


class SafetensorsStore(StateStore):
    """The state as safetensors files in ``directory`` (:func:`save`, :func:`load_latest`)."""

    def __init__(self, directory: Path, log: Callable[[str], None] = print):
        self.dir, self.log = Path(directory), log
        self._lock: int | None = None

    def _path(self, version: int) -> Path:
        return self.dir / f"state-{version:010d}.safetensors"

    def save(self, snap: Snapshot) -> None:
        save(self.dir, snap)

    def load(self, version: int) -> Snapshot:
        return _read(self._path(version))

    def theta_reader(self, version: int) -> tuple[BinaryIO, int]:
        return self.tensor_reader(version, "theta")

    def tensor_reader(self, version: int, name: str) -> tuple[BinaryIO, int]:
        path = self._path(version)
        fh = os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb")
        try:
            size = int.from_bytes(fh.read(8), "little")
            start, end = json.loads(fh.read(size))[name]["data_offsets"]
            fh.seek(8 + size + start)
        except (ValueError, KeyError, TypeError) as exc:
            fh.close()
            raise StateError(f"{path} is damaged ({exc}): {_FIX}") from None
        return fh, end - start

    def lock(self) -> None:
        """Hold ``hub.lock`` in the directory for this process's life: a second hub on it is refused."""
        path = self.dir / LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateError(
                f"--state {self.dir} is held by another hub (pid {holder}): stop that hub first, or give this "
                f"one another --state"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock = fd  # released when the process ends

    def _check_entries(self) -> None:
        for p in self.dir.iterdir():
            _no_link(p)

    def open(self, fresh: bool) -> Snapshot | None:
        path = self.dir
        if not path.exists():
            path.mkdir(parents=True)
            self.lock()
            self.log(f"hub: {path} did not exist: a new federation begins there")
            return None
        if not path.is_dir():
            raise StateError(f"--state {path} is not a directory: give a directory (it is created if missing)")
        _no_link(path / LOCK)
        self.lock()
        self._check_entries()
        if fresh:
            old = [p for p in path.iterdir() if p.name.startswith("state-")]
            if old:
                aside = path / f"discarded-{time.strftime('%Y%m%d-%H%M%S')}"
                aside.mkdir()
                for p in old:
                    p.rename(aside / p.name)
                self.log(f"hub: --fresh: the previous state moved to {aside}; a new federation begins")
            return None
        snap = load_latest(path)
        if snap is None:
            self.log(f"hub: no saved state in {path}: a new federation begins there")
        else:
            self.log(f"hub: resuming the federation of {path} at version {snap.version}")
        return snap
