"""The hub's durable state, behind one interface (:class:`StateStore`: open, save).

Its implementation, :class:`SafetensorsStore`: after every committed round, one safetensors file holding
θ_global, the outer optimizer's buffers and, in its metadata, the version, the federation's description
and its members; written atomically (temporary file, fsync, rename, fsync of the directory), the
last two kept. Tensors carry a CRC-32 each, so a damaged file is found, never trained on.
"""

from __future__ import annotations

import abc
import json
import os
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor

__all__ = ["KEEP", "SafetensorsStore", "Snapshot", "StateError", "StateStore", "load_latest", "save"]

KEEP = 2
_NAME = re.compile(r"^state-(\d{10})\.safetensors$")
_FORMAT = "xffl-hub-1"


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
        "crc32": {k: _crc(v) for k, v in tensors.items()},
    }
    final = directory / f"state-{snap.version:010d}.safetensors"
    tmp = directory / f".{final.name}.tmp"
    with open(tmp, "wb") as fh:
        _write_safetensors(fh, tensors, {"xffl": json.dumps(meta)})
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    _fsync_dir(directory)
    for old in _files(directory)[KEEP:]:
        old.unlink(missing_ok=True)
    return final


def _files(directory: Path) -> list[Path]:
    """The state files, newest first."""
    found = [p for p in directory.iterdir() if _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)), reverse=True)


def _read(path: Path) -> Snapshot:
    fix = "remove it to fall back to the previous round's file, or start the hub with --fresh (a new federation)"
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = json.loads((fh.metadata() or {}).get("xffl", "null"))
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
                raise StateError(f"{path} is not a hub state file ({_FORMAT}): {fix}")
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open has no iteration
    except (SafetensorError, OSError, ValueError) as exc:
        raise StateError(f"{path} is damaged or unreadable ({str(exc).splitlines()[0][:120]}): {fix}") from None
    sums = meta.get("crc32", {})
    if set(sums) != set(tensors) or any(_crc(t) != sums[k] for k, t in tensors.items()):
        raise StateError(f"{path} is damaged (a checksum does not match): {fix}")
    theta = tensors.pop("theta")
    return Snapshot(
        version=int(meta["version"]),
        spec=meta["spec"],
        theta=theta,
        buffers={k.removeprefix("outer."): v for k, v in tensors.items()},
        outer_steps=int(meta["outer_steps"]),
        progress=int(meta["progress"]),
        ended=bool(meta["ended"]),
        members=dict(meta["members"]),
    )


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
        """Keep ``snap`` durably before any member hears of it."""


class SafetensorsStore(StateStore):
    """The state as safetensors files in ``directory`` (:func:`save`, :func:`load_latest`)."""

    def __init__(self, directory: Path, log: Callable[[str], None] = print):
        self.dir, self.log = Path(directory), log

    def save(self, snap: Snapshot) -> None:
        save(self.dir, snap)

    def open(self, fresh: bool) -> Snapshot | None:
        path = self.dir
        if not path.exists():
            path.mkdir(parents=True)
            self.log(f"hub: {path} did not exist: a new federation begins there")
            return None
        if not path.is_dir():
            raise StateError(f"--state {path} is not a directory: give a directory (it is created if missing)")
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
