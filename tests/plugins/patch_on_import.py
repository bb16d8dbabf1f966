"""Patch a module of the job right after its first import (:func:`after_import`), for the hook modules.

A hook module is imported at start-up by ``sitecustomize``, before the job has imported anything; it
registers what to wrap here instead of importing the module itself, so a process that never imports it
(the hub, a launcher that only forks) stays as it was, and the job's own order of imports (and of its
environment settings before ``torch``) is unchanged. A patch runs once the module's code has run, before
anyone else uses it: it sees every class and function in place, and every later lookup sees the patch.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable

__all__ = ["after_import"]

_PENDING: dict[str, list[Callable]] = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Finds a pending module with the finders after it, and wraps its loader's ``exec_module``."""

    def find_spec(self, name, path, target=None):
        if name not in _PENDING:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        patches, run = _PENDING.pop(name), spec.loader.exec_module

        def exec_module(module):
            run(module)
            for patch in patches:
                patch(module)

        spec.loader.exec_module = exec_module  # this spec's own loader (one per module found)
        return spec


_FINDER = _Finder()


def after_import(name: str, patch: Callable) -> None:
    """Call ``patch(module)`` once module ``name`` is imported (now, if it already is)."""
    if name in sys.modules:
        patch(sys.modules[name])
        return
    _PENDING.setdefault(name, []).append(patch)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
