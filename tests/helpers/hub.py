"""Facilities as independent jobs meeting at a real hub (``python -m xffl_like.hub serve``), for the tests.

:class:`Hub` starts the hub on a free port (mutual TLS with a certificate directory, else ``--insecure``
on loopback) and can SIGKILL and restart it on the same state; :class:`Facility` is one facility's job,
``python -m xffl_like.run`` in a session of its own (killed as a group). With ``XFFL_TEST_DUMP_ROUNDS``
each facility's leader dumps every round (:func:`rounds`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from . import PLUGINS, REPO, TINY

__all__ = [
    "GEOMETRY",
    "SPEC",
    "Facility",
    "Hub",
    "free_port",
    "init_certs",
    "rounds",
    "serve",
    "small_spec",
    "wait_for",
]

ENV = {"PYTHONPATH": os.pathsep.join([str(PLUGINS), str(REPO)]), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def small_spec(numel: int = 6, grace_s: float = 60.0, max_norm_ratio: float = 10.0) -> dict:
    """A federation's description for hub tests in one process: one fp32 tensor ``w`` of ``numel`` values, 10
    rounds of a plain average, uniform weights."""
    return {
        "parameters": [["w", [numel], "float32"]],
        "algorithm": "federated",
        "outer": {"name": "average", "lr": 1.0, "momentum": 0.0, "betas": [0.9, 0.99], "eps": 1e-8, "offload": False},
        "compression": {"kind": "none", "chunk_size": 4096, "error_feedback": False},
        "every_s": None,
        "rounds": 10,
        "train.steps": None,
        "weights": "uniform",
        "grace_s": grace_s,
        "max_norm_ratio": max_norm_ratio,
        "weights_rule": None,
        "paced": False,
        "min_facilities": 1,
    }


#: :func:`small_spec`'s defaults, and the geometry its members declare.
SPEC = small_spec()
GEOMETRY = {"batch_size": 2, "seq_len": 8, "dp": 1}


def serve(fed, workers: int = 16, log=None):
    """A real gRPC server for ``fed`` (a :class:`~xffl_like.hub.server.federation.HubFederation`) in this process,
    ``--insecure`` on a free loopback port, started; returns (server, port)."""
    from concurrent import futures

    import grpc

    from xffl_like.hub.protocol.wire import GRPC_OPTIONS
    from xffl_like.hub.server.auth import IdentityInterceptor
    from xffl_like.hub.server.service import HubService

    interceptor = IdentityInterceptor(None, log=log) if log is not None else IdentityInterceptor(None)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=[interceptor],
                         options=GRPC_OPTIONS)  # fmt: skip
    server.add_generic_rpc_handlers((HubService(fed).handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout=240, what=""):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def init_certs(directory: Path, names: list[str]) -> Path:
    """A CA, the hub's identity (localhost, 127.0.0.1) and one per facility, by the hub's own command."""
    cmd = [sys.executable, "-m", "xffl_like.hub", "init", str(directory), "--facilities", ",".join(names),
           "--host", "localhost,127.0.0.1"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, **ENV}, cwd=REPO)
    return directory


class Hub:
    """A hub process on ``port`` (a free one) with its state in ``state``."""

    def __init__(self, tmp_path: Path, certs: Path | None = None, state: Path | None = None, name: str = "hub"):
        self.tmp, self.certs, self.name = tmp_path, certs, name
        self.state = state or tmp_path / f"{name}-state"
        self.port = free_port()
        self.address = f"{'localhost' if certs else '127.0.0.1'}:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.extra: list[str] = []  # more arguments of `serve` at the next start (e.g. --fresh)
        self.start()

    def start(self) -> None:
        self.log = self.tmp / f"{self.name}-{time.time_ns()}.log"
        mode = ["--certs", str(self.certs)] if self.certs else ["--insecure"]
        cmd = [sys.executable, "-m", "xffl_like.hub", "serve", "--port", str(self.port), "--state", str(self.state),
               *mode, *self.extra]  # fmt: skip
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT)
        wait_for(lambda: "serving on" in self.log.read_text() or self.proc.poll() is not None, 60, "the hub")
        assert self.proc.poll() is None, self.log.read_text()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.tmp.glob(f"{self.name}-*.log")))

    def identity(self, name: str) -> list[str]:
        """The overrides that give facility ``name`` its certificate (none for an --insecure hub)."""
        if not self.certs:
            return [f"federation.elastic.facility={name}"]
        c = self.certs
        return [f"federation.elastic.ca={c / 'ca.crt'}", f"federation.elastic.cert={c / 'facilities' / f'{name}.crt'}",
                f"federation.elastic.key={c / 'facilities' / f'{name}.key'}"]  # fmt: skip


class Facility:
    """One facility's job: ``python -m xffl_like.run`` in a session of its own (killed as a group)."""

    def __init__(self, name, hub: Hub, tmp_path, nproc=1, extra=(), env=None, resume=None, base=()):
        self.name, self.dir = name, tmp_path / f"run-{name}"
        self.dump = tmp_path / "dump"
        args = [
            "+experiment=llama_fed",
            "logger=none",
            "distributed.federated=null",
            f"distributed.nproc_per_node={nproc}",
            f"federation.elastic.hub={hub.address}",
            *hub.identity(name),
            "federation.elastic.timeout_s=20",
            "checkpoint.every_rounds=1",
            *TINY,
            *base,
            *extra,
        ]
        if resume:
            args.append(f"resume={resume}")
        env = {**os.environ, **ENV, "XFFL_TEST_DUMP_ROUNDS": str(self.dump), **(env or {})}
        self.out = open(tmp_path / f"{name}-{time.time_ns()}.log", "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={self.dir}"],
            cwd=REPO,
            env=env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait(self, timeout=300) -> tuple[int, str]:
        try:
            rc = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.out.seek(0)
        return rc, self.out.read()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())


def rounds(dump: Path, name: str) -> list[dict]:
    """The rounds facility ``name``'s leader took part in (joins excluded), in order."""
    return [torch.load(p) for p in sorted((dump / name).glob("round-*.pt"))]
