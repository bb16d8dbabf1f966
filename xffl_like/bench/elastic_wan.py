"""``python -m xffl_like.bench.wan bench.mode=elastic``: an elastic federation (``federation.elastic``)
over the emulated wide-area link, with faults.

Two facilities, each its own job (``python -m xffl_like.run`` with the local launcher, inside its
network namespace, its own process group), meet at a lighthouse on the bridge's own address
(:meth:`~.netns.Network.add_service_address`: a service node each facility reaches over its shaped
link). With ``bench.elastic.pin`` each facility's job runs on its own equal share of the CPUs (a site's
own machines; on a small machine the facilities would otherwise slow each other and a late joiner's
start-up alone would slow facility 0). Scenarios, one after the other, each with a fresh lighthouse:

- ``alone``: facility 0 by itself (the time it needs to reach the target without the federation);
- ``baseline``: both facilities from the start (``min_facilities=2``), no faults;
- ``late``: facility 1 starts ``bench.elastic.late_s`` seconds after facility 0 (``min_facilities=1``):
  it joins at a round boundary and heals;
- ``kill``: both from the start; once facility 1 has committed round ``bench.elastic.kill_round`` its
  whole process group is SIGKILLed; ``bench.elastic.restart_after_s`` later it starts again
  (``resume=<its run dir>``, or fresh with ``bench.elastic.restart=fresh``) and rejoins;
- ``heal``: ``bench.elastic.heal_overrides`` (``model=llama_bench``): facility 1 starts late, the round
  in which facility 0 heals it is measured on the link.

Figures: the target is the higher of ``alone``'s and ``baseline``'s final eval losses; each scenario's time
to it (facility 0's eval
losses after each round, from the start of its training) and the step at which it got there (what
other work on the machine does not change; each scenario's load average is printed beside it); the
survivors' stall (from the kill to
facility 0's next committed round, from the rounds' dump times, ``XFFL_TEST_DUMP_ROUNDS``) against
``timeout_s`` + one round of the baseline; the heal's round time (facility 0's record of the round in
which it healed facility 1) against twice the bytes the link carried then (interface counters) at line
rate. Each ratio is printed beside its goal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from .netns import CounterSampler, Facility, Network, busy_window, facility_cpus, tx_at

__all__ = ["run_elastic", "format_elastic", "SCENARIOS"]

SCENARIOS = ("alone", "baseline", "late", "kill", "heal")
_LIGHTHOUSE_PORT = 29610


def _start_lighthouse(service: Facility, port: int, heartbeat_s: float, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [
            *service.exec_prefix(),
            sys.executable,
            "-m",
            "xffl_like.lighthouse",
            "--port",
            str(port),
            "--bind",
            service.address,
            "--heartbeat-timeout-s",
            str(heartbeat_s),
        ],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.time() + 120  # torchft's import alone can take tens of seconds on a loaded machine
    while "lighthouse on" not in log.read_text():
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"the lighthouse did not start: {log.read_text()[-300:]}")
        time.sleep(0.2)
    return proc


def _stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
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


class _Facility:
    """One facility's job in its namespace: start, kill its process group, start again. With ``cpus``,
    the job (its launcher and every worker it starts) runs on those CPUs only: a site's own machines."""

    def __init__(
        self, fac: Facility, name: str, overrides: list[str], run_dir: Path, env: dict, cpus: list[int] | None = None
    ):
        self.fac, self.name, self.overrides, self.run_dir, self.env = fac, name, overrides, run_dir, env
        self.cpus = cpus
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self, extra: list[str] = ()) -> float:
        self.starts += 1
        cmd = [
            *self.fac.exec_prefix(),
            sys.executable,
            "-m",
            "xffl_like.run",
            *self.overrides,
            f"federation.elastic.facility={self.name}",
            f"hydra.run.dir={self.run_dir}",
            *extra,
        ]
        log = open(self.run_dir.parent / f"{self.name}.{self.starts}.log", "w")
        cpus = self.cpus
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **self.env, "GLOO_SOCKET_IFNAME": self.fac.interface},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
        )
        return time.time()

    def kill(self) -> float:
        at = time.time()
        _stop(self.proc)
        return at


def _dumps(where: Path, name: str) -> list[tuple[float, int]]:
    """(commit time, round) of every round ``name``'s leader committed (``XFFL_TEST_DUMP_ROUNDS`` files)."""
    out = []
    for p in (where / name).glob("round-*.pt"):
        _, index, ns = p.stem.split("-")
        out.append((int(ns) / 1e9, int(index)))
    return sorted(out)


def _wait(procs: list[subprocess.Popen], deadline: float) -> None:
    while any(p.poll() is None for p in procs):
        if time.time() > deadline:
            raise TimeoutError("timed out")
        time.sleep(0.2)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _curve(summary: dict) -> list[tuple[float, float, int]]:
    """(seconds since facility 0 started training, eval loss of θ_global, step) after each round."""
    t0 = summary["train_started_at"]
    return [(e["time"] - t0, e["loss_global"][0], e["step"]) for e in summary["eval_history"] if e.get("loss_global")]


def _scenario(
    name: str, network: Network, service: Facility, bench: dict, run_dir: Path, sampler: CounterSampler, port: int
) -> dict:
    e = bench["elastic"]
    dumps = run_dir / "dumps"
    heal = name == "heal"
    common = [
        *bench["common"],
        *(e["heal_overrides"] if heal else e["overrides"]),
        "distributed.federated=null",
        "distributed.hsdp=null",
        f"distributed.nproc_per_node={bench['nproc_per_facility']}",
        f"federation.elastic.lighthouse={service.address}:{port}",
        f"federation.elastic.timeout_s={e['timeout_s']}",
        f"federation.elastic.min_facilities={2 if name in ('baseline', 'kill') else 1}",
    ]
    if not heal:
        common += [f"train.steps={e['steps']}", f"federation.every={e['every']}", f"train.eval_every={e['every']}"]
    env = {"WANDB_MODE": "offline", "OMP_NUM_THREADS": str(bench["threads_per_process"])}
    if not heal:
        env["XFFL_TEST_DUMP_ROUNDS"] = str(dumps)
    load = os.getloadavg()[0]  # the machine's: other work on it slows every facility alike
    lighthouse = _start_lighthouse(service, port, e["heartbeat_timeout_s"], run_dir / "lighthouse.log")
    shares = facility_cpus(2) if e.get("pin") else None
    facilities = [
        _Facility(network.facilities[f], f"f{f}", common, run_dir / f"f{f}", env, shares[f] if shares else None)
        for f in range(2)
    ]
    out: dict = {"events": {}, "cpus": shares}
    deadline = time.time() + bench["timeout_s"]
    try:
        out["events"]["f0_started"] = facilities[0].start()
        if name in ("baseline", "kill"):
            out["events"]["f1_started"] = facilities[1].start()
        elif name in ("late", "heal"):
            time.sleep(e["late_s"] if name == "late" else e["heal_late_s"])
            out["events"]["f1_started"] = facilities[1].start()
        if name == "kill":
            while not any(r >= e["kill_round"] for _, r in _dumps(dumps, "f1")):
                if time.time() > deadline or facilities[1].proc.poll() is not None:
                    raise TimeoutError(f"facility 1 never committed round {e['kill_round']}")
                time.sleep(0.05)
            out["events"]["f1_killed"] = facilities[1].kill()
            time.sleep(e["restart_after_s"])
            extra = [f"resume={facilities[1].run_dir}"] if e["restart"] == "resume" else []
            if not extra:
                facilities[1].run_dir = run_dir / "f1-restarted"
            out["events"]["f1_restarted"] = facilities[1].start(extra)
        _wait([f.proc for f in facilities if f.proc is not None], deadline)
        codes = {f.name: f.proc.returncode for f in facilities if f.proc is not None}
        if any(codes.values()):
            raise RuntimeError(f"exit codes {codes}: see {run_dir}/f*.log")
    finally:
        for f in facilities:
            if f.proc is not None:
                _stop(f.proc)
        _stop(lighthouse)
    out["load"] = [load, os.getloadavg()[0]]
    s0 = _summary(facilities[0].run_dir)
    out["train_seconds"] = s0["train_seconds"]
    out["curve"] = _curve(s0)
    out["rounds"] = s0["federation"]["elastic"]["rounds"]
    out["round_seconds"] = s0["aggregation_seconds"]
    if name == "kill":
        killed = out["events"]["f1_killed"]
        after = [t for t, _ in _dumps(dumps, "f0") if t > killed]
        out["stall_seconds"] = after[0] - killed if after else None
        out["rejoined"] = any("f1" in r["healed"] and r["step"] > 0 for r in out["rounds"])
        out["attempts"] = [r["attempts"] for r in out["rounds"]]
    if heal:
        out.update(_heal(s0, sampler, bench))
    return out


def _heal(s0: dict, sampler: CounterSampler, bench: dict) -> dict:
    """The round in which facility 0 healed facility 1: its time (facility 0's record) and the bytes
    the link carried around it (facility 0's interface counters, over the busy window)."""
    rounds = s0["federation"]["elastic"]["rounds"]
    healed = [r for r in rounds if "f1" in r["healed"]]
    if not healed:
        return {"heal": None}
    step = healed[0]["step"]
    index = next((i for i, r in enumerate(s0["round_records"]) if r["step"] == step), None)
    if index is None:  # healed in facility 0's own join round (it was not training yet)
        return {"heal": None, "heal_step": step}
    seconds = s0["aggregation_seconds"][index]
    end = next(e["time"] for e in s0["eval_history"] if e["step"] == step)  # evaluated right after the round
    rate = bench["link_mbit"] * 1e6 / 8
    window = busy_window(sampler.samples, end - seconds - 5.0, end, rate)
    sent = 0.0
    if window:
        sent = max(b - a for a, b in zip(tx_at(sampler.samples, window[0]), tx_at(sampler.samples, window[1])))
    return {
        "heal": {
            "step": step,
            "round_seconds": seconds,
            "link_bytes": int(sent),
            "transfer_seconds": window[1] - window[0] if window else None,
            "line_rate_seconds": sent / rate,
            "ratio_to_line_rate": seconds / (sent / rate) if sent else None,
        }
    }


def _time_to(curve: list[tuple[float, float, int]], target: float) -> float | None:
    return next((point[0] for point in curve if point[1] <= target), None)


def _steps_to(curve: list[tuple[float, float, int]], target: float) -> int | None:
    """The first step at the target: what the machine's load does not change."""
    return next((point[2] for point in curve if point[1] <= target), None)


def run_elastic(bench: dict, network: Network, sampler: CounterSampler, run_dir: Path) -> dict:
    """Every scenario over ``network``; the report (also written as ``elastic.json``)."""
    service = network.add_service_address()
    e = bench["elastic"]
    results, failures = {}, {}
    for i, name in enumerate(s for s in SCENARIOS if s in e["scenarios"]):
        where = run_dir / "runs" / name
        where.mkdir(parents=True, exist_ok=True)
        print(f"[{name}] ...", flush=True)
        started = time.time()
        try:
            results[name] = _scenario(name, network, service, bench, where, sampler, _LIGHTHOUSE_PORT + 2 * i)
        except (RuntimeError, TimeoutError, OSError, KeyError, ValueError) as exc:
            failures[name] = str(exc).splitlines()[0]
            print(f"[{name}] failed: {failures[name]}", flush=True)
        network.kill_processes()
        print(f"[{name}] {time.time() - started:.1f} s", flush=True)
    return _elastic_report(bench, results, failures)


def _elastic_report(bench: dict, results: dict, failures: dict) -> dict:
    e = bench["elastic"]
    report = {
        "mode": "elastic",
        "link_mbit": bench["link_mbit"],
        "nproc_per_facility": bench["nproc_per_facility"],
        "elastic": e,
        "results": results,
        "failures": failures,
        "goals": {},
    }
    alone, base = results.get("alone"), results.get("baseline")
    finals = [r["curve"][-1][1] for r in (alone, base) if r and r["curve"]]
    target = max(finals) if finals else None  # the easier of the two: every scenario can reach it
    report["target_eval_loss"] = target
    for r in results.values():
        r["time_to_target_seconds"] = _time_to(r["curve"], target) if target is not None else None
        r["steps_to_target"] = _steps_to(r["curve"], target) if target is not None else None
    ref = lambda key: results[key]["time_to_target_seconds"] if key in results else None  # noqa: E731
    for _name, r in results.items():
        ttt = r["time_to_target_seconds"]
        r["x_baseline"] = ttt / ref("baseline") if ttt and ref("baseline") else None
        r["x_alone"] = ttt / ref("alone") if ttt and ref("alone") else None
    goals = report["goals"]
    kill = results.get("kill")
    if kill and base and kill.get("stall_seconds") is not None and base["round_seconds"]:
        one_round = base["train_seconds"] / max(1, len(base["round_seconds"]))  # local steps + round
        bound = float(e["timeout_s"]) + one_round
        goals["stall"] = {
            "seconds": kill["stall_seconds"],
            "bound_seconds": bound,
            "ratio": kill["stall_seconds"] / bound,
            "goal": "<= 1",
        }
    heal = (results.get("heal") or {}).get("heal")
    if heal and heal["ratio_to_line_rate"] is not None:
        goals["heal"] = {
            "round_seconds": heal["round_seconds"],
            "link_bytes": heal["link_bytes"],
            "ratio": heal["ratio_to_line_rate"],
            "goal": "<= 2",
        }
    late = results.get("late")
    if late and alone and target is not None:  # seconds None: facility 0 never reached the target (goal not met)
        goals["late"] = {
            "seconds": late["time_to_target_seconds"],
            "alone_seconds": alone["time_to_target_seconds"],
            "ratio": late["x_alone"],
            "final_eval_loss": late["curve"][-1][1] if late["curve"] else None,
            "steps": late["steps_to_target"],
            "alone_steps": alone["steps_to_target"],
            "goal": "<= 1",
        }
    return report


def _cpus_line(report: dict) -> list[str]:
    shares = next((r["cpus"] for r in report["results"].values() if r.get("cpus")), None)
    if not shares:
        return []
    return [
        " ".join(f"facility {f} on CPUs {','.join(map(str, c))};" for f, c in enumerate(shares))
        + " the lighthouse on any",
        "",
    ]


def format_elastic(report: dict) -> str:
    """The scenarios side by side, then the goals as ratios."""

    def fmt(v, spec=".2f"):
        return "-" if v is None else format(v, spec)

    lines = [
        f"elastic federation, 2 facilities x {report['nproc_per_facility']} processes, link "
        f"{report['link_mbit']:g} Mbit/s each way; target eval loss {fmt(report['target_eval_loss'], '.4f')} "
        f"(the higher final of alone and baseline)",
        "",
        *_cpus_line(report),
        "| scenario | facility 0 train s | rounds | final eval loss | time to target s | x baseline | x alone | "
        "step at target | load |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in report["results"].items():
        final = r["curve"][-1][1] if r["curve"] else None
        load = "-" if not r.get("load") else f"{r['load'][0]:.1f}-{r['load'][1]:.1f}"
        lines.append(
            f"| {name} | {r['train_seconds']:.1f} | {len(r['round_seconds'])} | {fmt(final, '.4f')} | "
            f"{fmt(r['time_to_target_seconds'], '.1f')} | {fmt(r['x_baseline'], '.3f')} | "
            f"{fmt(r['x_alone'], '.3f')} | {fmt(r.get('steps_to_target'), 'd')} | {load} |"
        )
    if any(r.get("load") for r in report["results"].values()):
        lines += [
            "",
            "load: the machine's 1-minute load average at the scenario's start and end, the benchmark's own "
            "processes included (about 2 per facility training); other work on the machine slows the "
            "facilities, the step at the target does not depend on it",
        ]
    g = report["goals"]
    lines.append("")
    if "stall" in g:
        lines.append(
            f"survivors' stall after the kill: {g['stall']['seconds']:.1f} s, "
            f"{g['stall']['ratio']:.2f} x (timeout_s + one round = {g['stall']['bound_seconds']:.1f} s); goal <= 1"
        )
    if "heal" in g:
        lines.append(
            f"heal round: {g['heal']['round_seconds']:.2f} s for {g['heal']['link_bytes'] / 1e6:.1f} MB on the "
            f"link, {g['heal']['ratio']:.2f} x those bytes at line rate; goal <= 2"
        )
    if "late" in g:
        late, head = g["late"], f"facility 1 {report['elastic']['late_s']} s late: facility 0"
        if late["seconds"] is None:
            lines.append(
                f"{head} did not reach the target {report['target_eval_loss']:.4f} (final eval loss "
                f"{fmt(late['final_eval_loss'], '.4f')}; alone at it in {fmt(late['alone_seconds'], '.1f')} s): "
                f"not reached; goal <= 1 x alone"
            )
        else:
            lines.append(
                f"{head} at the target in {late['seconds']:.1f} s, {fmt(late['ratio'])} x alone "
                f"({fmt(late['alone_seconds'], '.1f')} s); goal <= 1; at step {fmt(late['steps'], 'd')} "
                f"(alone: {fmt(late['alone_steps'], 'd')})"
            )
    for name, why in report["failures"].items():
        lines.append(f"failed: {name}: {why}")
    return "\n".join(lines)
