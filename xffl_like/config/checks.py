"""Type predicates for validating config values (YAML and Hydra give ``True`` where a number
is expected as easily as ``1``, and ``bool`` is an ``int`` in Python)."""

from __future__ import annotations

import os
import stat
from typing import Any

from .errors import ConfigError

__all__ = ["address", "is_int", "is_number", "not_regular"]


def is_int(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def not_regular(path: str | os.PathLike) -> str | None:
    """What ``path`` is when it is not a regular file on disk (``"a directory"``, ``"a character device"``,
    ``"a file of the kernel's /proc filesystem"``), else None (also when it does not exist: the caller
    says so in its own words).

    ``/dev/zero`` never ends, ``/proc/self/status`` changes between reads and claims size 0, a FIFO
    blocks: none of them is a corpus, a tokenizer or a model file, whatever their names say.
    """
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"unreadable: {exc.strerror or exc}"
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    )
    for test, kind in kinds:
        if test(mode):
            return kind
    if not stat.S_ISREG(mode):
        return "not a regular file"
    top = os.path.realpath(path).split(os.sep)[1:2]
    if top and top[0] in ("proc", "sys", "dev"):
        return f"a file of the kernel's /{top[0]} filesystem"
    return None


def address(value: str, key: str = "federation.elastic.hub") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ``ConfigError`` with one line otherwise."""
    text = str(value)
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
    else:
        host, sep, port = text.rpartition(":")
        if ":" in host:  # a bare IPv6 address: its port cannot be told from its last group
            sep = ""
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(
            f"{key}={value!r}: must be HOST:PORT or [IPv6]:PORT (the address `python -m xffl_like.hub serve` "
            f"prints, e.g. login1:29510)"
        )
    return host, int(port)
