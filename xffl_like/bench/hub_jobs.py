"""Facilities through a hub on this machine, for the benchmarks: a ``--insecure`` hub on loopback and the
facilities' jobs beside it (``python -m xffl_like.run`` each, started at once), as ``bench.hub_memory`` and
``bench.gpu``'s one-GPU federation run them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..distributed.launch import free_port
from .children import spawn

__all__ = ["free_port", "insecure_hub", "start_job", "wait_job"]


def start_job(args: list[str], run_dir: Path, env: dict) -> subprocess.Popen:
    """``python -m xffl_like.run args`` writing into ``run_dir``, started now."""
    cmd = [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={run_dir}"]
    return spawn(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_job(proc: subprocess.Popen, run_dir: Path, timeout: float) -> dict:
    """The job's ``summary.json`` once it ends; ``RuntimeError`` naming its last error line if it failed."""
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        lines = [x for x in err.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error")]
        raise RuntimeError(f"exit {proc.returncode}: {(errors or lines or ['no output'])[-1][:300]}")
    return json.loads((run_dir / "summary.json").read_text())


@contextmanager
def insecure_hub(state: Path, env: dict) -> Iterator[tuple[subprocess.Popen, int]]:
    """``python -m xffl_like.hub serve --insecure`` on a free loopback port with ``--state state``, serving once
    it yields ``(process, port)``; stopped (SIGTERM) on exit."""
    port = free_port()
    hub = spawn(
        [sys.executable, "-m", "xffl_like.hub", "serve", "--insecure", "--port", str(port), "--state", str(state)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        line = hub.stdout.readline()
        while line and "serving on" not in line:
            line = hub.stdout.readline()
        if not line:
            raise RuntimeError(f"the hub exited ({hub.wait()}) before serving")
        yield hub, port
    finally:
        hub.send_signal(signal.SIGTERM)
        hub.wait(timeout=30)
