"""Facilities as independent jobs meeting at a real hub (``python -m xffl_like.hub serve``), for the tests.

:class:`Hub` starts the hub on a free port (mutual TLS with a certificate directory, else ``--insecure``
on loopback) and can SIGKILL and restart it on the same state; :class:`Facility` is one facility's job,
``python -m xffl_like.run`` in a session of its own (killed as a group). With ``XFFL_TEST_DUMP_ROUNDS``
each facility's leader dumps every round (:func:`rounds`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from xffl_like.distributed.launch import free_port

from . import PLUGINS, REPO, TINY

__all__ = [
    "GEOMETRY",
    "SPEC",
    "STATE_FILE",
    "Facility",
    "Hub",
    "dumped",
    "export_of",
    "free_port",
    "init_certs",
    "newest_state",
    "output",
    "read_state",
    "rounds",
    "run_to_end",
    "serve",
    "small_spec",
    "state_version",
    "state_versions",
    "value_bits",
    "wait_alive",
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


def serve(fed, workers: int = 16, log=None, port: int = 0):
    """A real gRPC server for ``fed`` (a :class:`~xffl_like.hub.server.federation.HubFederation`) in this process,
    ``--insecure`` on loopback (``port``, or a free one), started; returns (server, port)."""
    from concurrent import futures

    import grpc

    from xffl_like.hub.protocol.wire import GRPC_OPTIONS
    from xffl_like.hub.server.auth import IdentityInterceptor
    from xffl_like.hub.server.service import HubService

    interceptor = IdentityInterceptor(None, log=log) if log is not None else IdentityInterceptor(None)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), interceptors=[interceptor],
                         options=GRPC_OPTIONS)  # fmt: skip
    server.add_generic_rpc_handlers((HubService(fed).handler(),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port


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
            "data.num_eval_batches=1",  # the evaluation before and after each round: one batch (no test reads it)
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


def run_to_end(*facilities: Facility) -> list[str]:
    """Wait for every facility to end (each killed as a group afterwards, whatever happened); each must exit 0.
    Their outputs."""
    try:
        ended = [f.wait() for f in facilities]
    finally:
        for f in facilities:
            f.kill()
    assert all(rc == 0 for rc, _ in ended), "".join(out for _, out in ended)
    return [out for _, out in ended]


def output(f: Facility) -> str:
    """What the facility's job printed so far."""
    return Path(f.out.name).read_text()


def wait_alive(predicate, timeout=240, what="", alive=()):
    """Poll ``predicate``; fail at ``timeout``, or as soon as a facility of ``alive`` has exited."""
    deadline = time.time() + timeout
    while not predicate():
        for f in alive:
            assert f.proc.poll() is None, (
                f"{f.name} exited ({f.proc.returncode}) while waiting for {what}:\n{output(f)}"
            )
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def dumped(f: Facility, version: int) -> bool:
    """Its leader dumped a round of ``version`` (without reading it)."""
    return any((f.dump / f.name).glob(f"round-{version:04d}-*.pt"))


STATE_FILE = re.compile(r"^state-(\d+)\.safetensors$")


def state_versions(hub: Hub) -> list[int]:
    """The versions of the hub's state files in ``--state`` now."""
    return sorted(int(m.group(1)) for p in hub.state.glob("state-*.safetensors") if (m := STATE_FILE.match(p.name)))


def state_version(hub: Hub) -> int:
    """The newest of :func:`state_versions` (-1: none)."""
    return max(state_versions(hub), default=-1)


def read_state(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """A hub state file's metadata (``xffl``) and tensors, read with safetensors alone."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["xffl"])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118 - safe_open has no iteration
    return meta, tensors


def newest_state(hub: Hub) -> tuple[dict, dict[str, torch.Tensor]]:
    """:func:`read_state` of the hub's newest state file."""
    return read_state(hub.state / f"state-{state_version(hub):010d}.safetensors")


def export_of(f: Facility) -> dict[str, torch.Tensor]:
    """The facility's export (``export.hf=true``: ``<run>/hf/*.safetensors``), read with safetensors alone."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted((f.dir / "hf").glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def value_bits(tensors) -> torch.Tensor:
    """Every value's bit pattern, sorted: equal for two models whose tensors hold the same values in another
    layout (the export's attention rows are in Hugging Face's order)."""
    return torch.cat([t.reshape(-1).view(torch.int32) for t in tensors]).sort().values
