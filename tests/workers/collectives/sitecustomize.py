"""Tests (``$XFFL_TEST_COLLECTIVES=DIR``, this folder first on ``PYTHONPATH``): every process of the job writes
``DIR/<pid>.log``, one line per collective it calls (``coll NAME GROUP_SIZE``) and one at the start of each
training step (``step S``), so that a test counts what crosses facilities between two steps."""

import os

if os.environ.get("XFFL_TEST_COLLECTIVES"):
    import functools
    import inspect

    import torch.distributed as dist

    _out: list = []

    def _log(line: str) -> None:
        if not _out:
            path = os.path.join(os.environ["XFFL_TEST_COLLECTIVES"], f"{os.getpid()}.log")
            _out.append(open(path, "a", buffering=1))  # noqa: SIM115 - open for the process's life
        _out[0].write(line + "\n")

    def _caller() -> str:
        """Where in xffl_like the collective was called (file:line of the innermost frame there)."""
        import sys

        frame = sys._getframe(2)
        while frame is not None and "xffl_like" not in frame.f_code.co_filename:
            frame = frame.f_back
        return "?" if frame is None else f"{frame.f_code.co_filename.split('xffl_like')[-1]}:{frame.f_lineno}"

    def _counted(name: str):
        fn = getattr(dist, name)
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            _log(f"coll {name} {dist.get_world_size(group)} {_caller()}")
            return fn(*args, **kwargs)

        return counted

    for _name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                  "all_to_all_single", "barrier", "all_gather_object", "broadcast_object_list", "gather",
                  "scatter", "reduce", "send", "recv", "isend", "irecv"):  # fmt: skip
        setattr(dist, _name, _counted(_name))

    from xffl_like.train import trainer as _trainer

    _step = _trainer.Trainer.train_step

    def _marked(self, step: int) -> None:
        _log(f"step {step}")
        return _step(self, step)

    _trainer.Trainer.train_step = _marked
