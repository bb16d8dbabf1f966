"""``python -m xffl_like.bench.wan bench.mode=hub``: facilities behind firewalls, each dialling out to a hub.

The network is :class:`~.netns.HubNetwork`: a namespace for the hub, one per facility, one veth pair from
each facility to the hub on its own subnet, each pair shaped at the link rate (``bench.hub.link_mbit``, null:
``bench.link_mbit``) both ways, no route between facilities. The hub (``python -m xffl_like.hub serve``) runs
in its namespace with a fresh ``--state`` per scenario; each facility is its own job (``python -m
xffl_like.run ... federation.elastic.hub=...``, one process group, optionally pinned to its share of the
CPUs) in its namespace, dialling out to the hub's address on its own link over mutual TLS (certificates
from ``python -m xffl_like.hub init``, made once per run). Both facilities start together (the first to join
creates the federation, the other downloads θ_0), but for ``line``. Scenarios (``bench.hub.scenarios``), one
after the other:

- ``line``: ``bench.hub.bytes_overrides`` (a model whose bytes, not its arithmetic, make the round) over
  mutual TLS, the facilities dialling the hub directly; ``f1`` starts once ``f0`` has created the federation
  (a late joiner: it downloads θ_global). Figures: each round's time (the least of its accepted
  facilities' recorded round seconds: the last to arrive waited least, its time is the round's own) against
  the time its bytes need at the line rate (uplink + downlink, 2 x 4 x numel with compression none): goal
  <= :data:`GOAL_LINE` (the median round); the late joiner's time to hold θ_global (its join's record) against
  4 x numel at line rate: goal <= :data:`GOAL_JOIN`; each facility's link bytes (interface counters) against
  the payload its records account for.
- ``tls`` and ``insecure``: the same run, once over mutual TLS and once against ``serve --insecure``. An
  insecure hub listens on 127.0.0.1 only and a facility dials plaintext only to a loopback address, so both
  legs go through the same user-space TCP relays (:func:`relay`, this module's ``relay`` command): one in the
  hub's namespace (its link addresses -> the hub on its loopback) and one per facility (its loopback -> the
  hub's address on its link). The legs differ only in TLS. Figure: median round time TLS / insecure - 1:
  goal <= :data:`GOAL_TLS`.
- ``kill_facility``: ``bench.hub.fault_overrides``, TLS; once ``f1`` has taken part in
  ``bench.hub.kill_after_rounds`` rounds its process group is SIGKILLed. Figure: the survivor's stall (from the
  kill to ``f0``'s next round result, seen when its row shows in ``f0``'s ``aggregation.csv``, which is read
  every :data:`_POLL_S` s) against ``grace_s`` + one round (the median interval between ``f0``'s results before
  the kill): goal <= 1. Both facilities' round results are seen that way (the kill's moment too).
- ``kill_hub``: as ``kill_facility`` with rounds of ``bench.hub.kill_hub_every`` steps (a local phase longer
  than the hub's restart, mostly its imports), but the hub is SIGKILLed once both facilities hold the result
  of the same round, ``f1``'s ``bench.hub.kill_after_rounds``-th, and started again
  ``bench.hub.restart_after_s`` later on the same ``--state``. Figure: rounds lost (per facility, the rounds
  between its last accepted one before the kill and its first accepted one after, the worst facility; plus
  any committed version the restarted hub lacks): goal <= :data:`GOAL_LOST`; beside it the outage (kill to
  serving again), the interval between ``f0``'s round boundaries, and how many lost rounds had their boundary
  after the hub served again (each round's end from the facility's ``eval_history``: it evaluates right
  after each round).

Every scenario also gives each facility's overhead over compute (:func:`overhead_figure`): its training's
seconds over the seconds its slowest rank spent outside the link; the ``line`` scenario's worst facility is
set beside :data:`GOAL_OVERHEAD` (issue 37's goal for ``federation.delay=1``, passed through
``bench.hub.bytes_overrides``).

Writes ``wan.json`` (the report) and ``wan.md`` into the run directory, as every mode.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import hub_rounds
from .netns import HUB_SUBNET, HubNetwork, facility_cpus

__all__ = [
    "SCENARIOS",
    "GOAL_LINE",
    "GOAL_JOIN",
    "GOAL_TLS",
    "GOAL_STALL",
    "GOAL_LOST",
    "GOAL_OVERHEAD",
    "line_seconds",
    "overhead_figure",
    "round_times",
    "round_figure",
    "join_figure",
    "tls_figure",
    "stall_figure",
    "rounds_lost",
    "lost_figure",
    "payload_bytes",
    "relay",
    "run_hub",
    "run_hub_mode",
    "check_hub",
    "format_hub",
]

SCENARIOS = ("line", "tls", "insecure", "kill_facility", "kill_hub")
#: Goals: a round's time over its bytes' time at line rate (median round) ...
GOAL_LINE = 1.5
#: ... the late joiner's time to hold θ_global over 4 x numel at line rate ...
GOAL_JOIN = 1.5
#: ... TLS's round time over the insecure one's, less 1 ...
GOAL_TLS = 0.10
#: ... the survivors' stall over grace_s + one round ...
GOAL_STALL = 1.0
#: ... and the rounds lost to a hub SIGKILL and restart.
GOAL_LOST = 1
#: ... and, with federation.delay=1, a facility's training time over its compute time.
GOAL_OVERHEAD = 1.05
#: The phases of a facility's phase table that are not compute: its rounds (joins included) and its waits.
_LINK_PHASES = ("aggregation", "wait")

_REPO = Path(__file__).resolve().parents[2]
_PORT = 29720  # the hub's port in its namespace; scenario i uses _PORT + 10 * i (and the next two for relays)
#: ``bench.hub.facilities``: how many facilities (one namespace each, its own shaped link to the hub's) ...
FACILITIES = (2, 8)
#: ... and ``bench.hub.compression``: what their rounds send (``federation.compression``; topk with error feedback).
COMPRESSIONS = ("none", "bf16", "uint8", "topk")


def _names(n: int) -> list[str]:
    """The facilities' names: ``f0`` creates the federation, ``f1`` is the one killed."""
    return [f"f{i}" for i in range(n)]


_POLL_S = 0.05  # how often the facilities' aggregation.csv are read for new round results


# ---------------------------------------------------------------------------------------------- figures (pure)
def line_seconds(nbytes: float, mbit: float) -> float:
    """Seconds ``nbytes`` need at ``mbit`` Mbit/s."""
    return nbytes * 8.0 / (mbit * 1e6)


def round_times(records: dict[str, list[dict]]) -> dict[int, float]:
    """version -> that round's time: the least of the recorded seconds (``federation.elastic.rounds``) of the
    facilities whose contribution it accepted (the last to arrive waited least: its time is the round's own)."""
    out: dict[int, float] = {}
    for recs in records.values():
        for r in recs:
            if r.get("status") == "accepted" and r.get("round") is not None:
                version = int(r["round"]) + 1  # the record's round: the index of the round committed
                out[version] = min(out.get(version, math.inf), float(r["seconds"]))
    return dict(sorted(out.items()))


def round_figure(times: dict[int, float], numel: int, up_mbit: float, down_mbit: float) -> dict | None:
    """The rounds' times against the time their bytes need at line rate: 4 x numel up and 4 x numel down."""
    if not times:
        return None
    line = line_seconds(4 * numel, up_mbit) + line_seconds(4 * numel, down_mbit)
    median = statistics.median(times.values())
    return {
        "rounds": len(times),
        "median_seconds": median,
        "max_seconds": max(times.values()),
        "line_seconds": line,
        "ratio": median / line,
        "max_ratio": max(times.values()) / line,
        "goal": GOAL_LINE,
    }


def join_figure(records: list[dict], numel: int, down_mbit: float) -> dict | None:
    """A late joiner's join (its record with status ``joined``: Join, then θ_global downloaded) against 4 x numel
    at its downlink's rate."""
    join = next((r for r in records if r.get("status") == "joined"), None)
    if join is None:
        return None
    line = line_seconds(4 * numel, down_mbit)
    return {"seconds": join["seconds"], "line_seconds": line, "ratio": join["seconds"] / line, "goal": GOAL_JOIN}


def tls_figure(tls: dict[int, float], insecure: dict[int, float]) -> dict | None:
    """Median round time over TLS against the insecure leg's, less 1 (both through the same relays)."""
    if not tls or not insecure:
        return None
    a, b = statistics.median(tls.values()), statistics.median(insecure.values())
    return {
        "tls_seconds": a,
        "insecure_seconds": b,
        "rounds": [len(tls), len(insecure)],
        "cost": a / b - 1.0,
        "goal": GOAL_TLS,
    }


def stall_figure(killed_at: float, results: list[float], grace_s: float) -> dict | None:
    """The survivor's stall: from ``killed_at`` to its first round result after it (``results``: the times it
    received each round's result), against ``grace_s`` + one round (the median interval between its results,
    the one that spans the kill left out; None without one)."""
    results = sorted(results)
    after = [t for t in results if t > killed_at]
    intervals = [b - a for a, b in zip(results, results[1:]) if not a <= killed_at < b]
    if not after or not intervals:
        return None
    one_round = statistics.median(intervals)
    stall = after[0] - killed_at
    bound = grace_s + one_round
    return {
        "seconds": stall,
        "one_round_seconds": one_round,
        "bound_seconds": bound,
        "ratio": stall / bound,
        "goal": GOAL_STALL,
    }


def rounds_lost(records: dict[str, list[dict]], version_at_kill: int) -> dict[str, list[int]]:
    """Per facility, the steps of the rounds it lost to the hub's outage: its records after its last accepted
    round that the hub had committed by the kill (version <= ``version_at_kill``) up to its next accepted one
    (missed, or healed: it contributed nothing)."""
    out = {}
    for name, recs in records.items():
        last = max(
            (i for i, r in enumerate(recs) if r.get("status") == "accepted" and int(r["round"]) + 1 <= version_at_kill),
            default=None,
        )
        if last is None:
            continue
        lost = []
        for r in recs[last + 1 :]:
            if r.get("status") == "accepted":
                break
            lost.append(int(r["step"]))
        out[name] = lost
    return out


def lost_figure(
    lost: dict[str, list[int]], boundaries: dict[str, dict[int, float]], down: tuple[float, float], forgotten: int
) -> dict | None:
    """Rounds lost (the worst facility's, plus versions the restarted hub forgot) and, of them, those whose
    boundary came after the hub served again (``down``: kill time, serving again; ``boundaries``: per facility,
    step -> the time its round there ended)."""
    if not lost:
        return None
    after = {
        n: sum(1 for step in steps if boundaries.get(n, {}).get(step, math.inf) > down[1]) for n, steps in lost.items()
    }
    worst = max(len(steps) for steps in lost.values()) + forgotten
    return {
        "rounds": worst,
        "per_facility": {n: len(s) for n, s in lost.items()},
        "after_hub_back": after,
        "versions_forgotten": forgotten,
        "outage_seconds": down[1] - down[0],
        "goal": GOAL_LOST,
    }


def overhead_figure(summary: dict) -> float | None:
    """A facility's training seconds over its compute: the most any of its ranks spent outside the link (every
    phase of its table but ``aggregation``, where joins, rounds and a delayed round's landing are timed, and
    ``wait``). 1.0: its rounds are hidden behind its steps."""
    per_rank = summary["phases"]["per_rank"]
    compute = max(sum(v["total_s"] for k, v in phases.items() if k not in _LINK_PHASES) for phases in per_rank.values())
    return summary["train_seconds"] / compute if compute > 0 else None


def payload_bytes(records: list[dict], numel: int) -> tuple[int, int]:
    """(up, down) bytes a facility's rounds carried, by its records: its parameters up when it created the
    federation or contributed (accepted or rejected), θ_global down when it joined, contributed or healed."""
    up = down = 0
    for r in records:
        status = r.get("status")
        if status in ("created", "accepted", "rejected"):
            up += 4 * numel
        if status in ("joined", "accepted", "rejected", "healed"):
            down += 4 * numel
    return up, down


# ---------------------------------------------------------------------------------------------- the relay
def _pipe(src: socket.socket, dst: socket.socket, done: threading.Event) -> None:
    try:
        while chunk := src.recv(1 << 18):
            dst.sendall(chunk)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
    finally:
        done.set()


def _serve_connection(conn: socket.socket, target: tuple[str, int]) -> None:
    try:
        up = socket.create_connection(target, timeout=10)
    except OSError:
        conn.close()
        return
    up.settimeout(None)
    for s in (conn, up):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    dones = [threading.Event(), threading.Event()]
    threads = [
        threading.Thread(target=_pipe, args=(conn, up, dones[0]), daemon=True),
        threading.Thread(target=_pipe, args=(up, conn, dones[1]), daemon=True),
    ]
    for t in threads:
        t.start()
    for d in dones:
        d.wait()
    conn.close()
    up.close()


def relay(listen: tuple[str, int], target: tuple[str, int], max_s: float) -> None:
    """Forward every TCP connection to ``listen`` to ``target`` (a thread pair per connection, each direction
    copied as it comes, the write side shut on EOF), for at most ``max_s`` seconds."""
    srv = socket.create_server(listen, reuse_port=False)
    srv.settimeout(0.5)
    print(f"relay: {listen[0]}:{listen[1]} -> {target[0]}:{target[1]}", flush=True)
    deadline = time.time() + max_s
    while time.time() < deadline:
        try:
            conn, _ = srv.accept()
        except TimeoutError:
            continue
        threading.Thread(target=_serve_connection, args=(conn, target), daemon=True).start()
    srv.close()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str] | None = None) -> int:
    """``python -m xffl_like.bench.hub_wan relay LISTEN TARGET --max-s S`` (the bench starts it in a namespace)."""
    p = argparse.ArgumentParser(prog="python -m xffl_like.bench.hub_wan")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("relay", help="forward TCP connections from LISTEN (HOST:PORT) to TARGET")
    r.add_argument("listen")
    r.add_argument("target")
    r.add_argument("--max-s", type=float, default=900.0)
    args = p.parse_args(argv)
    relay(_address(args.listen), _address(args.target), args.max_s)
    return 0


# ---------------------------------------------------------------------------------------------- processes
def _wait_line(log: Path, text: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while text not in (log.read_text() if log.exists() else ""):
        if proc.poll() is not None or time.time() > deadline:
            tail = log.read_text()[-300:] if log.exists() else ""
            how = f"exited {proc.returncode}" if proc.poll() is not None else "timed out"
            raise RuntimeError(f"{what} did not start ({how}): {tail}")
        time.sleep(0.1)


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    """``sig`` to ``proc``'s process group (its own session), then wait for it (SIGKILL after 30 s)."""
    if proc is None:
        return
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class _Hub:
    """``python -m xffl_like.hub serve`` in the hub's namespace (its own session), on ``state``."""

    def __init__(self, net: HubNetwork, where: Path, port: int, certs: Path | None, bind: str, env: dict):
        self.net, self.where, self.port, self.certs, self.bind, self.env = net, where, port, certs, bind, env
        self.state = where / "hub-state"
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.log = where / "hub.0.log"

    def start(self) -> float:
        self.starts += 1
        self.log = self.where / f"hub.{self.starts}.log"
        mode = ["--certs", str(self.certs), "--bind", self.bind] if self.certs else ["--insecure"]
        cmd = [
            sys.executable,
            "-m",
            "xffl_like.hub",
            "serve",
            "--port",
            str(self.port),
            "--state",
            str(self.state),
            *mode,
        ]
        with open(self.log, "w") as out:
            self.proc = self.net.popen("hub", cmd, cwd=_REPO, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        _wait_line(self.log, "serving on", self.proc, 120, "the hub")
        return time.time()

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.where.glob("hub.*.log")))

    def numel(self) -> int | None:
        m = re.search(r"created the federation \((\d+) parameters\)", self.logs())
        return int(m.group(1)) if m else None

    def version(self) -> int:
        found = re.findall(r"committed version (\d+)", self.logs())
        return max((int(v) for v in found), default=0)


class _Job:
    """One facility's job (``python -m xffl_like.run``) in its namespace, its own process group."""

    def __init__(self, net: HubNetwork, index: int, overrides: list[str], where: Path, env: dict, cpus):
        self.net, self.index, self.name = net, index, f"f{index}"
        self.overrides, self.where, self.env, self.cpus = overrides, where, env, cpus
        self.run_dir = where / self.name
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        cmd = [
            sys.executable,
            "-m",
            "xffl_like.run",
            *self.overrides,
            f"federation.elastic.facility={self.name}",
            f"hydra.run.dir={self.run_dir}",
        ]
        cpus = self.cpus
        with open(self.where / f"{self.name}.log", "w") as out:
            self.proc = self.net.popen(
                self.index,
                cmd,
                cwd=_REPO,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
            )
        return time.time()

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())

    def records(self) -> list[dict]:
        return self.summary()["federation"]["elastic"]["rounds"]


class _Results:
    """Each facility's round results, live, from its ``aggregation.csv``: its rank 0 appends a row there (and
    flushes it) after every round (docs/outputs.md); a row with a round number is the result of a round the hub
    committed, which the facility now holds (a round it missed has none; its join is no row). A thread reads the
    files every :data:`_POLL_S` seconds and stamps each new row with the time it first saw it."""

    def __init__(self, jobs: list[_Job]):
        self.files = {j.name: j.run_dir / "aggregation.csv" for j in jobs}
        self.rows = dict.fromkeys(self.files, 0)
        self.held: dict[str, list[tuple[float, int]]] = {name: [] for name in self.files}
        self.lock, self.done = threading.Lock(), threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True, name="hub-wan-results")

    def __enter__(self) -> _Results:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.done.wait(_POLL_S):
            self.poll()

    def poll(self) -> None:
        """Read the files once: the rows that are new since the last read."""
        for name, path in self.files.items():
            rows, seen = _written_rows(path), time.time()
            with self.lock:
                for row in rows[self.rows[name] :]:
                    if row.get("round"):
                        self.held[name].append((seen, int(row["round"]) + 1))
                self.rows[name] = max(self.rows[name], len(rows))  # the job's last rewrite adds none

    def __call__(self, name: str) -> list[tuple[float, int]]:
        """(time first seen, version) of every round result facility ``name`` holds, in order."""
        with self.lock:
            return list(self.held[name])


def _written_rows(path: Path) -> list[dict]:
    """The rows of a CSV file that is being appended to, a line still being written left out."""
    try:
        lines = path.read_text().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    if lines and not lines[-1].endswith("\n"):
        lines.pop()
    return list(csv.DictReader(lines))


def _wait(procs: list[subprocess.Popen], deadline: float) -> None:
    while any(p.poll() is None for p in procs):
        if time.time() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.2)


def _wait_for(predicate, deadline: float, jobs: list[_Job], what: str) -> None:
    while not predicate():
        for j in jobs:
            if j.proc is not None and j.proc.poll() is not None:
                raise RuntimeError(f"{j.name} exited ({j.proc.returncode}) while waiting for {what}: see {j.where}")
        if time.time() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------- scenarios
def _environment(bench: dict) -> dict:
    """The hub's, the relays' and the facilities' environment."""
    return {
        **os.environ,
        "PYTHONPATH": str(_REPO),
        "WANDB_MODE": "offline",
        "GRPC_VERBOSITY": "ERROR",
        "OMP_NUM_THREADS": str(bench["threads_per_process"]),
    }


def _start_relays(net: HubNetwork, where: Path, port: int, max_s: float, env: dict, relays: list) -> None:
    """The relays of the ``tls`` and ``insecure`` legs, each appended to ``relays`` once started: in the hub's
    namespace its link addresses -> its loopback, in each facility's its loopback -> the hub's link address."""
    specs = [("hub", f"0.0.0.0:{port + 1}", f"127.0.0.1:{port}")]
    specs += [(i, f"127.0.0.1:{port + 2}", f"{net.hub_address(i)}:{port + 1}") for i in range(len(net.facilities))]
    for k, (ns, listen, target) in enumerate(specs):
        log = where / f"relay{k}.log"
        with open(log, "w") as fh:
            proc = net.popen(
                ns,
                [sys.executable, "-m", "xffl_like.bench.hub_wan", "relay", listen, target, "--max-s", str(max_s)],
                cwd=_REPO,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
            )
        relays.append(proc)
        _wait_line(log, "relay:", proc, 60, f"relay {listen}")


def _facility_jobs(name: str, net: HubNetwork, bench: dict, where: Path, certs: Path, port: int, env: dict):
    """Scenario ``name``'s two facility jobs (not started yet) and their CPU shares (None: not pinned)."""
    h = bench["hub"]
    tls, relayed, fault = name != "insecure", name in ("tls", "insecure"), name in ("kill_facility", "kill_hub")
    n, names = len(net.facilities), _names(len(net.facilities))
    dial = [f"127.0.0.1:{port + 2}"] * n if relayed else [f"{net.hub_address(i)}:{port}" for i in range(n)]
    prefix = {"kill_facility": "fault", "kill_hub": "kill_hub"}.get(name, "bytes")
    steps, every = h[f"{prefix}_steps"], h[f"{prefix}_every"]
    common = [
        *bench["common"],
        *(h["fault_overrides"] if fault else h["bytes_overrides"]),
        "distributed.federated=null",
        "distributed.hsdp=null",
        f"distributed.nproc_per_node={h['nproc']}",
        f"train.steps={steps}",
        f"federation.every={every}",
        "federation.elastic.min_facilities=1",
        f"federation.elastic.grace_s={h['grace_s']}",
        f"federation.elastic.timeout_s={h['call_timeout_s']}",
    ]
    if h.get("compression", "none") != "none":
        common += [f"federation.compression={h['compression']}"]
        common += ["federation.error_feedback=true"] if h["compression"] == "topk" else []
    shares = facility_cpus(n) if h.get("pin") else None
    jobs = []
    for i in range(n):
        ident = (
            [
                f"federation.elastic.ca={certs / 'ca.crt'}",
                f"federation.elastic.cert={certs / 'facilities' / f'{names[i]}.crt'}",
                f"federation.elastic.key={certs / 'facilities' / f'{names[i]}.key'}",
            ]
            if tls
            else []
        )
        overrides = [*common, f"federation.elastic.hub={dial[i]}", *ident]
        jobs.append(_Job(net, i, overrides, where, env, shares[i] if shares else None))
    return jobs, shares


def _play(name: str, h: dict, hub: _Hub, jobs: list[_Job], results: _Results, out: dict, deadline: float):
    """Start the facilities, run scenario ``name``'s events (in ``out``) until the jobs end; the time of its
    kill (None without one)."""
    events, killed, k = out["events"], None, int(h["kill_after_rounds"])
    events["f0_started"] = jobs[0].start()
    if name == "line":  # f1 joins late: θ_global is downloaded
        _wait_for(lambda: hub.numel() is not None, deadline, jobs[:1], "f0 to create the federation")
        events["created"] = time.time()
    for j in jobs[1:]:  # with line, late joiners: they download θ_global
        events[f"{j.name}_started"] = j.start()
    if name == "kill_facility":
        _wait_for(lambda: len(results("f1")) >= k, deadline, jobs, f"f1's round {k}")
        _stop(jobs[1].proc)
        events["f1_killed"] = killed = time.time()
        out["version_at_kill"] = max(v for _, v in results("f1"))
        _wait([j.proc for j in jobs if j.name != "f1"], deadline)
    elif name == "kill_hub":

        def same_round() -> bool:  # f1 holds k results, the last of them the same round's as f0's last
            f0, f1 = results("f0"), results("f1")
            return len(f1) >= k and bool(f0) and f0[-1][1] == f1[-1][1]

        _wait_for(same_round, deadline, jobs, f"f1's round {k}")
        _stop(hub.proc)
        events["hub_killed"] = killed = time.time()
        out["version_at_kill"] = hub.version()
        time.sleep(float(h["restart_after_s"]))
        events["hub_serving_again"] = hub.start()
        resumed = re.search(r"at version (\d+)", hub.log.read_text())
        out["version_resumed"] = int(resumed.group(1)) if resumed else 0
        _wait([j.proc for j in jobs], deadline)
    else:
        _wait([j.proc for j in jobs], deadline)
    codes = {j.name: j.proc.returncode for j in jobs if j.proc is not None}
    if name == "kill_facility":
        codes.pop("f1")
    if any(codes.values()):
        raise RuntimeError(f"exit codes {codes}: see {jobs[0].where}/f*.log")
    return killed


def _collect(name: str, h: dict, hub: _Hub, jobs: list[_Job], results: _Results, out: dict, killed) -> dict:
    """The figures of scenario ``name`` from its jobs' records and summaries, into ``out``."""
    numel = hub.numel()
    out["numel"] = numel
    records = {j.name: j.records() for j in jobs if (j.run_dir / "summary.json").exists()}
    out["records"] = records
    out["round_times"] = round_times(records)
    out["payload_bytes"] = {n: list(payload_bytes(r, numel)) for n, r in records.items()}
    out["train_seconds"] = {j.name: j.summary()["train_seconds"] for j in jobs if j.name in records}
    out["overhead"] = {j.name: overhead_figure(j.summary()) for j in jobs if j.name in records}
    if name == "kill_facility":
        out["stall"] = stall_figure(killed, [t for t, _ in results("f0")], float(h["grace_s"]))
    if name == "kill_hub":
        out["lost"] = rounds_lost(records, out["version_at_kill"])
        out["boundaries"] = {  # step -> when its round ended (each round is evaluated right after it)
            j.name: {e["step"]: e["time"] for e in j.summary()["eval_history"]} for j in jobs if j.name in records
        }
        times = sorted(out["boundaries"].get("f0", {}).values())
        intervals = [b - a for a, b in zip(times, times[1:])]
        out["round_interval_seconds"] = statistics.median(intervals) if intervals else None
    return out


def _scenario(name: str, net: HubNetwork, bench: dict, where: Path, certs: Path, port: int) -> dict:
    """One scenario over ``net``: a fresh hub on ``port``, the two facilities, the scenario's events; its
    result (events, records, figures)."""
    h, env = bench["hub"], _environment(bench)
    tls, relayed = name != "insecure", name in ("tls", "insecure")
    hub = _Hub(net, where, port, certs if tls else None, "127.0.0.1" if relayed else "0.0.0.0", env)
    relays: list[subprocess.Popen] = []
    jobs, shares = _facility_jobs(name, net, bench, where, certs, port, env)
    out: dict = {"events": {}, "tls": tls, "relayed": relayed, "load": [os.getloadavg()[0]], "cpus": shares}
    deadline = time.time() + float(h["timeout_s"])
    counters0 = net.counters()
    try:
        hub.start()
        if relayed:
            _start_relays(net, where, port, float(h["timeout_s"]) + 60, env, relays)
        with _Results(jobs) as results, hub_rounds.LinkSampler(net.counters) as links:
            out["events"]["started"] = time.time()
            killed = _play(name, h, hub, jobs, results, out, deadline)
    finally:
        for j in jobs:
            _stop(j.proc)
        _stop(hub.proc, signal.SIGTERM)
        for r in relays:
            _stop(r)
    out["load"].append(os.getloadavg()[0])
    counters1 = net.counters()
    names = _names(len(net.facilities))
    out["link_bytes"] = {n: [b[0] - a[0], b[1] - a[1]] for n, a, b in zip(names, counters0, counters1)}
    out = _collect(name, h, hub, jobs, results, out, killed)
    windows = hub_rounds.round_windows({n: results(n) for n in names}, out["events"]["started"])
    latencies = hub_rounds.hub_latencies(hub.logs())
    accepted = hub_rounds.accepted_by_version(out["records"])
    out["rounds"] = hub_rounds.round_rows(links.samples, windows, out["round_times"], latencies, net.link_mbit,
                                          net.down_mbit, accepted)  # fmt: skip
    return out


def run_hub(bench: dict, run_dir: Path) -> dict:
    """Every scenario of ``bench.hub.scenarios`` over one :class:`HubNetwork` of two facilities; the report."""
    h = bench["hub"]
    link = float(h.get("link_mbit") or bench["link_mbit"])
    certs = run_dir / "certs"
    n = int(h.get("facilities", 2))
    net_hosts = [f"{HUB_SUBNET}.{i}.1" for i in range(n)]  # HubNetwork's hub addresses (checked below)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "xffl_like.hub",
            "init",
            str(certs),
            "--facilities",
            ",".join(_names(n)),
            "--host",
            ",".join([*net_hosts, "127.0.0.1", "localhost"]),
        ],
        cwd=_REPO,
        env={**os.environ, "PYTHONPATH": str(_REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"python -m xffl_like.hub init failed: {(proc.stderr or proc.stdout).strip()[-300:]}")
    results, failures = {}, {}
    with HubNetwork(n, link, h.get("hub_multiple")) as net:
        if net.hub_addresses != net_hosts:
            raise RuntimeError(f"the hub's addresses {net.hub_addresses} are not the certificate's {net_hosts}")
        for i, name in enumerate(s for s in SCENARIOS if s in h["scenarios"]):
            where = run_dir / "runs" / name
            where.mkdir(parents=True, exist_ok=True)
            print(f"[{name}] ...", flush=True)
            started = time.time()
            try:
                results[name] = _scenario(name, net, bench, where, certs, _PORT + 10 * i)
            except (RuntimeError, TimeoutError, OSError, KeyError, ValueError) as exc:
                failures[name] = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                print(f"[{name}] failed: {failures[name]}", flush=True)
            net.kill_processes()
            print(f"[{name}] {time.time() - started:.1f} s", flush=True)
        up, down = net.link_mbit, net.down_mbit
        tcp = net.tcp
    return _report(bench, results, failures, up, down, tcp)


def _report(bench: dict, results: dict, failures: dict, up: float, down: float, tcp: dict) -> dict:
    h = bench["hub"]
    report = {
        "mode": "hub",
        "link_mbit": up,
        "down_mbit": down,
        "tcp": tcp,
        "hub": h,
        "results": results,
        "failures": failures,
        "goals": {},
    }
    goals = report["goals"]
    line = results.get("line")
    if line and line["numel"] and h.get("compression", "none") == "none":  # fp32 payload both ways
        fig = round_figure(line["round_times"], line["numel"], up, down)
        if fig:
            goals["line"] = fig
    fig = hub_rounds.rounds_figure(line["rounds"], int(h.get("facilities", 2))) if line else None
    if fig:
        goals["rounds"] = {**fig, "goal": hub_rounds.rounds_goal(int(h.get("facilities", 2)))}
        if line["numel"]:
            goals["bytes"] = hub_rounds.bytes_figure(fig, line["numel"])
    if line and line["numel"]:
        join = join_figure(line["records"].get("f1", []), line["numel"], down)
        if join:
            goals["join"] = join
    if line and line.get("overhead"):
        worst = max((v for v in line["overhead"].values() if v is not None), default=None)
        if worst is not None:
            goals["overhead"] = {"ratio": worst, "per_facility": line["overhead"]}
    if "tls" in results and "insecure" in results:
        fig = tls_figure(results["tls"]["round_times"], results["insecure"]["round_times"])
        if fig:
            goals["tls"] = fig
    kill = results.get("kill_facility")
    if kill and kill.get("stall"):
        goals["stall"] = kill["stall"]
    hubk = results.get("kill_hub")
    if hubk and hubk.get("lost"):
        forgot = max(0, hubk["version_at_kill"] - hubk["version_resumed"])
        down = (hubk["events"]["hub_killed"], hubk["events"]["hub_serving_again"])
        fig = lost_figure(hubk["lost"], hubk["boundaries"], down, forgot)
        if fig:
            goals["lost"] = {**fig, "round_interval_seconds": hubk["round_interval_seconds"]}
    return report


_LISTS = ("scenarios", "bytes_overrides", "fault_overrides")
_POSITIVE_INT = (
    "nproc",
    "bytes_steps",
    "bytes_every",
    "fault_steps",
    "fault_every",
    "kill_hub_steps",
    "kill_hub_every",
    "kill_after_rounds",
)
_POSITIVE = ("grace_s", "call_timeout_s", "timeout_s")


def check_hub(bench: dict) -> str | None:
    """What is wrong with ``bench.hub`` (one line), or None."""
    h = bench.get("hub")
    if not isinstance(h, dict):
        return "bench.hub is missing (conf/bench_wan.yaml)"
    n, lo, hi = h.get("facilities", 2), *FACILITIES
    if not (isinstance(n, int) and not isinstance(n, bool) and lo <= n <= hi):
        return f"bench.hub.facilities={n!r}: must be an integer from {lo} to {hi} (one network namespace each)"
    if h.get("compression", "none") not in COMPRESSIONS:
        return f"bench.hub.compression={h.get('compression')!r}: choose from {', '.join(COMPRESSIONS)}"
    for key in _LISTS:
        v = h.get(key)
        if not isinstance(v, list) or not all(isinstance(o, str) for o in v):
            return f"bench.hub.{key}={v!r}: must be a list of strings"
    unknown = [s for s in h["scenarios"] if s not in SCENARIOS]
    if unknown or not h["scenarios"]:
        return f"bench.hub.scenarios={h['scenarios']!r}: choose from {list(SCENARIOS)}"
    for key in _POSITIVE_INT:
        v = h.get(key)
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            return f"bench.hub.{key}={v!r}: must be a positive integer"
    for key in _POSITIVE:
        v = h.get(key)
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
            return f"bench.hub.{key}={v!r}: must be a positive number"
    for key in ("link_mbit", "hub_multiple"):
        v = h.get(key)
        if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
            return f"bench.hub.{key}={v!r}: must be a positive number or null"
    v = h.get("restart_after_s")
    if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < math.inf):
        return f"bench.hub.restart_after_s={v!r}: must be a number >= 0"
    for prefix in ("bytes", "fault", "kill_hub"):
        if h[f"{prefix}_steps"] < 2 * h[f"{prefix}_every"]:
            return (
                f"bench.hub.{prefix}_steps={h[f'{prefix}_steps']} < 2 x {prefix}_every={h[f'{prefix}_every']}: "
                f"the scenarios need rounds"
            )
    return None


def run_hub_mode(plain: dict, bench: dict, run_dir: Path) -> dict | None:
    """``bench.mode=hub`` from :mod:`.wan` (which checked ``bench.hub`` with :func:`check_hub`): run the
    scenarios, write ``wan.json`` and ``wan.md``; None when namespaces cannot be made here (the reason printed)."""
    from .netns import NetnsError, cleanup_on_signals, prepare_run_dir

    if not prepare_run_dir(plain, run_dir):
        return None
    with cleanup_on_signals():
        try:
            report = run_hub(bench, run_dir)
        except NetnsError as exc:
            print(f"bench.wan skipped: cannot build network namespaces here: {exc}", flush=True)
            return None
    (run_dir / "wan.json").write_text(json.dumps(report, indent=2) + "\n")
    (run_dir / "wan.md").write_text(format_hub(report) + "\n")
    return report


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def _round_goal_lines(g: dict, h: dict) -> list[str]:
    """The figures of the line scenario's rounds beside their goals."""
    lines = []
    if "line" in g:
        x = g["line"]
        lines.append(
            f"| round time / its bytes at line rate (median of {x['rounds']} rounds; 2 x 4 x numel = "
            f"{x['line_seconds']:.2f} s) | {x['ratio']:.2f} x ({x['median_seconds']:.2f} s; worst "
            f"{x['max_ratio']:.2f} x) | <= {GOAL_LINE:g} x | {_met(x['ratio'] <= GOAL_LINE)} |"
        )
    if "rounds" in g:
        x = g["rounds"]
        lines.append(
            f"| round time / the bytes its links carried at line rate (the slowest facility's up then down; median "
            f"of the {x['rounds']} rounds after the first that accepted every facility; {x['line_seconds']:.2f} s) "
            f"| {x['ratio']:.2f} x ({x['seconds']:.2f} s; worst {x['max_ratio']:.2f} x) | <= {x['goal']:g} x | "
            f"{_met(x['ratio'] <= x['goal'])} |"
        )
        lines.append(
            f"| the hub's time from a round's last upload to its result's first byte (median) / the round | "
            f"{_fmt(x['hub_latency_share'], '.1%')} ({_fmt(x['hub_latency_s'], '.3f')} s) | small | |"
        )
        lines.append(f"| the hub's egress per round (median; all facilities' downloads) | "
                     f"{x['hub_egress'] / 1e6:.2f} MB | | |")  # fmt: skip
    if "bytes" in g:
        x = g["bytes"]
        ok = _met(x["ratio"] <= x["goal"]) if h.get("compression") == "topk" else "(goal for topk)"
        lines.append(
            f"| a facility's bytes per round, up + down (the most of any, median round; link bytes) / an fp32 "
            f"round's payload (8 x numel = {x['fp32_bytes'] / 1e6:.2f} MB) | 1/{1 / x['ratio']:.1f} "
            f"({x['bytes'] / 1e6:.3f} MB) | <= 1/{1 / x['goal']:g} | {ok} |"
        )
    if "overhead" in g:
        x = g["overhead"]
        each = ", ".join(f"{n} {v:.3f}" for n, v in x["per_facility"].items() if v is not None)
        lines.append(
            f"| training time / compute time (the worst facility; {each}) | {x['ratio']:.3f} | <= {GOAL_OVERHEAD:g} "
            f"(federation.delay=1) | {_met(x['ratio'] <= GOAL_OVERHEAD)} |"
        )
    return lines


def _fault_goal_lines(g: dict, h: dict) -> list[str]:
    """The join's, TLS's and the faults' figures beside their goals."""
    lines = []
    if "join" in g:
        x = g["join"]
        lines.append(
            f"| late joiner's time to hold θ_global / 4 x numel at line rate ({x['line_seconds']:.2f} s) | "
            f"{x['ratio']:.2f} x ({x['seconds']:.2f} s) | <= {GOAL_JOIN:g} x | {_met(x['ratio'] <= GOAL_JOIN)} |"
        )
    if "tls" in g:
        x = g["tls"]
        lines.append(
            f"| TLS's cost: median round TLS / insecure - 1 (both legs through the same user-space TCP relays) | "
            f"{100 * x['cost']:+.1f} % ({x['tls_seconds']:.2f} s vs {x['insecure_seconds']:.2f} s) | "
            f"<= {100 * GOAL_TLS:g} % | {_met(x['cost'] <= GOAL_TLS)} |"
        )
    if "stall" in g:
        x = g["stall"]
        lines.append(
            f"| survivors' stall after a facility's SIGKILL / (grace_s {h['grace_s']:g} s + one round "
            f"{x['one_round_seconds']:.1f} s) | {x['ratio']:.2f} x ({x['seconds']:.1f} s) | <= 1 x | "
            f"{_met(x['ratio'] <= GOAL_STALL)} |"
        )
    if "lost" in g:
        x = g["lost"]
        lines.append(
            f"| rounds lost to a hub SIGKILL + restart on its --state (outage {x['outage_seconds']:.1f} s from the "
            f"kill to serving again, f0's boundaries every {_fmt(x['round_interval_seconds'], '.1f')} s; per "
            f"facility {x['per_facility']}, of them after the hub served again {x['after_hub_back']}; versions "
            f"forgotten {x['versions_forgotten']}) | {x['rounds']} | <= {GOAL_LOST} | "
            f"{_met(x['rounds'] <= GOAL_LOST)} |"
        )
    return lines


def format_hub(report: dict) -> str:
    """Each figure beside its goal, what each scenario did, then the line scenario's rounds one by one."""
    h, g = report["hub"], report["goals"]
    down, n, comp = report["down_mbit"], int(h.get("facilities", 2)), h.get("compression", "none")
    lines = [
        f"facilities behind firewalls: {n} facilities x {h['nproc']} process(es), each reaching only the hub over "
        f"its own link, {report['link_mbit']:g} Mbit/s up and {down:g} Mbit/s down (tc tbf on both ends; no "
        f"latency added); federation.compression={comp}; TCP "
        f"{report['tcp'].get('net.ipv4.tcp_congestion_control', '?')}",
        "",
        "| figure | value | goal | |",
        "|---|---|---|---|",
        *_round_goal_lines(g, h),
        *_fault_goal_lines(g, h),
        "",
        "| scenario | path | rounds (versions) | median round s | hub: last upload -> first result byte, median s "
        "| hub egress MB per round, median | link MB f0 up/down | payload MB f0 up/down | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        path = ("TLS" if r["tls"] else "insecure") + (" via relays" if r["relayed"] else ", direct")
        times, rows = r["round_times"], r.get("rounds") or []
        lat = [x["hub_latency_s"] for x in rows if x["hub_latency_s"] is not None]
        egress = [x["hub_egress"] for x in rows[1:]]
        link = r["link_bytes"].get("f0", [0, 0])
        pay = r["payload_bytes"].get("f0", [0, 0])
        pay_mb = f"{pay[0] / 1e6:.1f}/{pay[1] / 1e6:.1f}" if comp == "none" else "-"
        lines.append(
            f"| {name} | {path} | {len(times)} | {_fmt(statistics.median(times.values()) if times else None)} | "
            f"{_fmt(statistics.median(lat) if lat else None, '.3f')} | "
            f"{_fmt(statistics.median(egress) / 1e6 if egress else None)} | "
            f"{link[0] / 1e6:.1f}/{link[1] / 1e6:.1f} | {pay_mb} | {r['load'][0]:.1f}-{r['load'][-1]:.1f} |"
        )
    lines += [
        "",
        "round time: per version, the least recorded round seconds of its accepted facilities (the last to arrive "
        "waited least). relays: an insecure hub listens on loopback only and a facility sends plaintext only to a "
        "loopback address, so the tls/insecure legs both go through a user-space TCP relay in each facility's "
        "namespace and one in the hub's (this module's `relay`); line, kill_facility and kill_hub dial the hub "
        "directly over mutual TLS. load: the machine's 1-minute load average at the scenario's start and end.",
    ]
    if report["results"].get("line", {}).get("rounds"):
        lines += ["", "line, round by round (link counters; a round's window runs from the last facility holding "
                  "the previous result to the last holding this one):", ""]  # fmt: skip
        lines += hub_rounds.format_rounds(report["results"]["line"]["rounds"], _names(n))
    for name, why in report["failures"].items():
        lines.append(f"failed: {name}: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
