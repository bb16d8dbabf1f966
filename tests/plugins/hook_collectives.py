"""``$XFFL_TEST_COLLECTIVES=DIR``: every process of the job writes ``DIR/<pid>.log``, one line per collective it
calls (``coll NAME GROUP_SIZE WHERE``) and one at the start of each training step (``step S``), so that a test
counts what crosses facilities between two steps.

The seams: ``torch.distributed``'s collectives (module attributes, looked up at each call as ``dist.NAME``)
and ``Trainer.train_step``, each wrapped right after its module's first import.
"""

import functools
import inspect
import os
import sys

from patch_on_import import after_import

ENV = "XFFL_TEST_COLLECTIVES"
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list", "gather", "scatter",
               "reduce", "send", "recv", "isend", "irecv")  # fmt: skip

_out: list = []


def _log(line: str) -> None:
    if not _out:
        path = os.path.join(os.environ[ENV], f"{os.getpid()}.log")
        _out.append(open(path, "a", buffering=1))  # noqa: SIM115 - open for the process's life
    _out[0].write(line + "\n")


def _caller() -> str:
    """Where in xffl_like the collective was called (file:line of the innermost frame there)."""
    frame = sys._getframe(2)
    while frame is not None and "xffl_like" not in frame.f_code.co_filename:
        frame = frame.f_back
    return "?" if frame is None else f"{frame.f_code.co_filename.split('xffl_like')[-1]}:{frame.f_lineno}"


def _count_collectives(dist) -> None:
    def counted(name: str):
        fn = getattr(dist, name)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            _log(f"coll {name} {dist.get_world_size(group)} {_caller()}")
            return fn(*args, **kwargs)

        return wrapper

    for name in COLLECTIVES:
        setattr(dist, name, counted(name))


def _mark_steps(trainer) -> None:
    step = trainer.Trainer.train_step

    def train_step(self, index: int) -> None:
        _log(f"step {index}")
        return step(self, index)

    trainer.Trainer.train_step = train_step


if os.environ.get(ENV):
    after_import("torch.distributed", _count_collectives)
    after_import("xffl_like.train.trainer", _mark_steps)
