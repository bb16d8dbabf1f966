"""The hub's durable state, behind one interface (:class:`StateStore`: open, save).

Its implementation, :class:`SafetensorsStore`: after every committed round, one safetensors file holding
θ_global, the outer optimizer's buffers and, in its metadata, the version, the federation's description
and its members; written atomically (temporary file, fsync, rename, fsync of the directory), the
last two kept. The tensors carry a CRC-32 each and the metadata (which holds them) one of its own, so a
damaged file is found, never trained on; on load θ_global and the buffers must have the sizes the
federation's description gives. Nothing in ``--state`` is a symbolic link (none is followed), and one hub
at a time holds it (an exclusive lock on ``hub.lock``, for the hub's life).

The hub holds no tensor of the model's size in memory: a version's tensors are mapped from its file
(:meth:`StateStore.load`: pages the kernel reads and drops, private, never written), and the next version is
written window by window as it is computed (:func:`save` with :class:`Windows`): its header first, with
fixed-width room for the checksums, each tensor's values at their place, the checksums last. Before anything
is written the disk must have room for the file plus :data:`MARGIN` (:class:`NoRoom` otherwise, one line
naming ``--state`` and the bytes needed and free), and the file's blocks are reserved (``posix_fallocate``).

Bytes per round: the hub writes and fsyncs one file of ``8 + H + 4 N (1 + B)`` bytes (``N`` parameters, ``B``
outer buffers: 0 for ``average``, 1 for momentum and Nesterov, 2 for Adam; ``H`` the JSON header, kilobytes:
the description and the members), its header written twice (``H`` more), and fsyncs the directory once.
``llama_tiny`` (853,120 parameters) with Nesterov: 6,828,632 bytes (3,672 of header), 3.42 MB with
``average``; ``llama_bench`` (58.5 M): 468 MB. It reads the previous version's tensors (the same ``4 N (1 +
B)``, from the page cache when it is warm) and each accepted upload's spool file once. A version begun while
its round's uploads stream in (:meth:`StateStore.begin`, :mod:`.ahead`) has :data:`SLACK` more bytes of header;
one dropped unfinished (the round decided otherwise) was written, never fsynced, and the round's version is
written again. A compressed round first makes its record durable (:mod:`.journal`: its accepted messages, fsynced
as they were spooled, and a JSON file of a few KB), then writes this file behind it.
"""

from __future__ import annotations

import abc
import errno
import fcntl
import json
import mmap
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

from ..protocol.spec import SpecError, numel_of

__all__ = ["KEEP", "MARGIN", "SLACK", "NoRoom", "Pending", "SafetensorsStore", "Snapshot", "StateError", "StateStore",
           "Windows", "described", "fill", "fsync_dir", "load_latest", "room", "save", "snapshot_of"]  # fmt: skip

KEEP = 2
MARGIN = 64 << 20  # free bytes left on --state's disk beyond the next version's file (the spool, the log)
SLACK = 64 << 10  # header room of a version begun before its round is decided, for its members' history
_NAME = re.compile(r"^state-(\d{10})\.safetensors$")
_FORMAT = "xffl-hub-2"  # the metadata checksummed too ("xffl-hub-1": tensors only, still read)
_FORMATS = ("xffl-hub-1", _FORMAT)
LOCK = "hub.lock"
JOURNAL = "journal"  # the compressed rounds' records (:mod:`.journal`)


class StateError(RuntimeError):
    """The hub's state directory cannot be used (one line naming the file and the fix)."""


class NoRoom(StateError):
    """``--state``'s disk lacks room for the next version: refused before anything is written."""


@dataclass
class Snapshot:
    """What the hub keeps across restarts."""

    version: int  # rounds committed
    spec: dict[str, Any]  # the federation's description (the first facility's)
    theta: Tensor | None  # θ_global, flat fp32 (None: a version logged in the journal, its file not written yet)
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


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a rename in it is durable after)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Windows:
    """The tensors of a version to save, produced window by window instead of held whole: ``names`` (``theta``,
    then each outer buffer's), ``numel`` values each, and ``items``, which yields for consecutive windows
    ``{name: values}`` (the same number of values for every name; fp32)."""

    names: tuple[str, ...]
    numel: int
    items: Iterator[dict[str, Tensor]]


def _whole(snap: Snapshot) -> Windows:
    """``snap``'s own tensors as :class:`Windows` of 16 M values."""
    tensors = {"theta": snap.theta, **snap.buffers}
    numel = snap.theta.numel()
    for name, t in tensors.items():
        if t.dtype != torch.float32 or not t.is_contiguous() or t.numel() != numel:
            raise ValueError(f"{name}: the hub saves contiguous fp32 tensors of θ_global's size")
    step = 16 << 20
    items = ({k: t.view(-1)[i : i + step] for k, t in tensors.items()} for i in range(0, numel, step))
    return Windows(tuple(tensors), numel, items)


def described(snap: Snapshot) -> dict[str, Any]:
    """What a version is besides its tensors (its file's metadata, a journal record's: :mod:`.journal`)."""
    return {
        "version": snap.version,
        "spec": snap.spec,
        "outer_steps": snap.outer_steps,
        "progress": snap.progress,
        "ended": snap.ended,
        "members": snap.members,
        "federation": snap.federation,
    }  # fmt: skip


def snapshot_of(meta: dict, theta: Tensor | None = None, buffers: dict[str, Tensor] | None = None) -> Snapshot:
    """The :class:`Snapshot` that :func:`described` gave ``meta`` (KeyError, TypeError, ValueError when it does not
    hold one), with ``theta`` and ``buffers`` (None: a version whose file is not written yet)."""
    return Snapshot(
        version=int(meta["version"]),
        spec=dict(meta["spec"]),
        theta=theta,
        buffers=buffers or {},
        outer_steps=int(meta["outer_steps"]),
        progress=int(meta["progress"]),
        ended=bool(meta["ended"]),
        members=dict(meta["members"]),
        federation=str(meta.get("federation", "")),
    )


def _meta(snap: Snapshot, sums: dict[str, str]) -> str:
    return json.dumps({"format": _FORMAT, **described(snap), "crc32": sums})


def _header(snap: Snapshot, keys: list[str], numel: int, sums: dict[str, str], size: int = 0) -> bytes:
    """The safetensors header (its 8-byte length, the JSON, padded to 8 or to ``size`` bytes in all): the tensors
    side by side, in order."""
    text = _meta(snap, sums)
    header: dict = {"__metadata__": {"xffl": text, "xffl_crc32": f"{zlib.crc32(text.encode()):08x}"}}
    for i, k in enumerate(keys):
        header[k] = {"dtype": "F32", "shape": [numel], "data_offsets": [4 * numel * i, 4 * numel * (i + 1)]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * max(-len(raw) % 8, size - 8 - len(raw))  # the data starts 8-byte aligned (JSON allows the spaces)
    return len(raw).to_bytes(8, "little") + raw


def room(directory: Path, nbytes: int) -> None:
    """:class:`NoRoom` unless ``directory``'s filesystem has ``nbytes`` free plus :data:`MARGIN`."""
    free = shutil.disk_usage(directory).free
    if free < nbytes + MARGIN:
        raise NoRoom(
            f"--state {directory} has {free} bytes free; the next version needs {nbytes + MARGIN} ({nbytes} for "
            f"its file and a margin of {MARGIN}): free space on its disk or move --state to a larger one"
        )


class Pending:
    """The next version's file, written aside (``.state-<version>.safetensors.tmp``): its header first, with
    room for the checksums (fixed width) and ``slack`` bytes more, each tensor's values then put in order
    (:meth:`put`) at their place, the header and checksums last; :meth:`finish` makes it the newest version
    (fsync, rename, fsync of the directory), :meth:`abort` removes it (nothing kept changed). The disk's free
    room is checked, and the file's blocks reserved, before any value is put. ``slack``: room for the header of
    a version whose metadata (its members' history) is known only at :meth:`finish` (:mod:`.ahead`)."""

    def __init__(self, directory: Path, snap: Snapshot, names: tuple[str, ...], numel: int, slack: int = 0):
        self.snap, self.numel, self.dir = snap, numel, directory
        self.keys = ["theta" if k == "theta" else f"outer.{k}" for k in names]
        self.sums = dict.fromkeys(self.keys, 0)
        self.done = dict.fromkeys(self.keys, 0)
        head = _header(snap, self.keys, numel, dict.fromkeys(self.keys, "0" * 8))
        if slack:
            head = _header(snap, self.keys, numel, dict.fromkeys(self.keys, "0" * 8), len(head) + slack + 7 & ~7)
        self.base, size = len(head), len(head) + 4 * numel * len(self.keys)
        room(directory, size)
        self.final = directory / f"state-{snap.version:010d}.safetensors"
        self.tmp = directory / f".{self.final.name}.tmp"
        self.tmp.unlink(missing_ok=True)  # a crash's leftover (a link is removed, never followed)
        self.fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(self.fd, 0, size)  # a disk that fills meanwhile fails here, not mid-round
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        _pwrite(self.fd, head, 0)

    def put(self, name: str, values: Tensor) -> None:
        key = "theta" if name == "theta" else f"outer.{name}"
        at = self.done[key]
        if values.dtype != torch.float32 or at + values.numel() > self.numel:
            raise ValueError(f"{key}: values past its {self.numel} (or not fp32)")
        raw = memoryview(values.contiguous().view(-1).view(torch.uint8).numpy())
        _pwrite(self.fd, raw, self.base + 4 * (self.numel * self.keys.index(key) + at))
        self.sums[key] = zlib.crc32(raw, self.sums[key])
        self.done[key] = at + values.numel()

    def fits(self, snap: Snapshot) -> bool:
        """Whether ``snap``'s header (metadata, checksums) fits the room this file's header was given."""
        return len(_header(snap, self.keys, self.numel, dict.fromkeys(self.keys, "0" * 8))) <= self.base

    def finish(self, snap: Snapshot | None = None) -> Path:
        """The file becomes the saved version, its metadata ``snap``'s (default: the one it was begun with; the
        same version), and the older files beyond :data:`KEEP` go."""
        short = [k for k, n in self.done.items() if n != self.numel]
        if short:
            raise ValueError(f"the next version lacks values of {', '.join(short)}")
        snap = snap or self.snap
        if snap.version != self.snap.version:
            raise ValueError(f"version {snap.version} finished in the file of version {self.snap.version}")
        head = _header(snap, self.keys, self.numel, {k: f"{v:08x}" for k, v in self.sums.items()}, self.base)
        if len(head) != self.base:  # the checksums have a fixed width; the metadata must fit the room given
            raise ValueError("the state file's header changed size")
        _pwrite(self.fd, head, 0)
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd = None
        os.replace(self.tmp, self.final)
        fsync_dir(self.dir)
        for old in _files(self.dir)[KEEP:]:
            old.unlink(missing_ok=True)
        return self.final

    def abort(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self.tmp.unlink(missing_ok=True)  # a full disk keeps no partial file


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view[: 1 << 30], offset)
        view, offset = view[n:], offset + n


def save(directory: Path, snap: Snapshot, windows: Windows | None = None) -> Path:
    """Write ``snap`` (its tensors from ``windows``, else its own) as ``state-<version>.safetensors``
    atomically; keep the last :data:`KEEP`. :class:`NoRoom` before anything is written when the disk lacks
    room for it."""
    windows = windows or _whole(snap)
    return fill(Pending(directory, snap, windows.names, windows.numel), windows)


def fill(out: Pending, windows: Windows, snap: Snapshot | None = None) -> Path:
    """Put every window of ``windows`` into ``out`` and finish it (its metadata ``snap``'s, default the one it was
    begun with); removed unfinished if anything fails."""
    try:
        for window in windows.items:
            for name, values in window.items():
                out.put(name, values)
        return out.finish(snap)
    except BaseException:
        out.abort()
        raise


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


def _mapped(path: Path) -> dict[str, Tensor]:
    """The file's tensors (fp32, flat as saved), mapped from the file, not read into memory: pages the kernel
    can drop and read again (private: a write to one would never reach the file)."""
    with open(path, "rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        header = json.loads(fh.read(size))
        data = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    out = {}
    for k, entry in header.items():
        if k == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        if entry["dtype"] != "F32" or (end - start) % 4:
            raise ValueError(f"{k} is {entry['dtype']}, the hub saves F32")
        t = torch.frombuffer(data, dtype=torch.float32, count=(end - start) // 4, offset=8 + size + start)
        out[k] = t.view(entry["shape"])
    return out


def _read(path: Path, verify: bool = True) -> Snapshot:
    """The saved version in ``path``, its tensors mapped (:func:`_mapped`); ``verify``: their checksums too."""
    _no_link(path)
    try:
        with safe_open(str(path), framework="pt") as fh:  # the safetensors header's own checks
            meta = _metadata(path, fh)
        tensors = _mapped(path)
    except (SafetensorError, OSError, ValueError, OverflowError, KeyError, TypeError) as exc:
        raise StateError(f"{path} is damaged or unreadable ({str(exc).splitlines()[0][:120]}): {_FIX}") from None
    sums = meta.get("crc32", {})
    if not isinstance(sums, dict) or set(sums) != set(tensors):
        raise StateError(f"{path} is damaged (a checksum does not match): {_FIX}")
    if verify and any(_crc(t) != sums[k] for k, t in tensors.items()):
        raise StateError(f"{path} is damaged (a checksum does not match): {_FIX}")
    try:
        theta = tensors.pop("theta")
        snap = snapshot_of(meta, theta, {k.removeprefix("outer."): v for k, v in tensors.items()})
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
    def save(self, snap: Snapshot, windows: Windows | None = None) -> None:
        """Keep ``snap`` durably before any member hears of it, its tensors from ``windows`` when given (raises,
        changing nothing kept, when it cannot; :class:`NoRoom` before writing anything)."""

    @abc.abstractmethod
    def load(self, version: int, verify: bool = True) -> Snapshot:
        """The saved ``version``, its tensors mapped from disk (:class:`StateError` when it is gone or damaged;
        ``verify``: their checksums checked, a read of the whole version)."""

    @abc.abstractmethod
    def theta_reader(self, version: int) -> tuple[BinaryIO, int]:
        """θ_global of the saved ``version``: an open file at its first byte and its bytes. The version stays
        readable through it whatever is saved meanwhile (readers never hold a commit)."""

    def tensor_reader(self, version: int, name: str) -> tuple[BinaryIO, int]:
        """As :meth:`theta_reader`, for the saved tensor ``name`` (``theta``, or ``outer.<buffer>``)."""
        raise NotImplementedError(f"{type(self).__name__} reads θ_global only")

    def begin(self, snap: Snapshot, names: tuple[str, ...], numel: int) -> Pending | None:
        """The next version's file, to be written while a round's uploads stream in and finished (or aborted)
        when it is decided (:mod:`.ahead`), with room for a header grown by :data:`SLACK` bytes; None when the
        store writes versions only whole (:meth:`save`). :class:`NoRoom` as :meth:`save`."""
        return None


class SafetensorsStore(StateStore):
    """The state as safetensors files in ``directory`` (:func:`save`, :func:`load_latest`)."""

    def __init__(self, directory: Path, log: Callable[[str], None] = print):
        self.dir, self.log = Path(directory), log
        self._lock: int | None = None

    def _path(self, version: int) -> Path:
        return self.dir / f"state-{version:010d}.safetensors"

    def save(self, snap: Snapshot, windows: Windows | None = None) -> None:
        save(self.dir, snap, windows)

    def begin(self, snap: Snapshot, names: tuple[str, ...], numel: int) -> Pending:
        return Pending(self.dir, snap, names, numel, SLACK)

    def load(self, version: int, verify: bool = True) -> Snapshot:
        return _read(self._path(version), verify)

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
            old = [p for p in path.iterdir() if p.name.startswith("state-") or p.name == JOURNAL]
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
