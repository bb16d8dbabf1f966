"""``python -m xffl_like.bench.wan``: the federated algorithms across an emulated wide-area link.

Every facility runs in its own network namespace (:mod:`.netns`), joined to the others by a
link shaped at ``bench.link_mbit`` each way. Each algorithm config is the real main job,
``python -m xffl_like.run <overrides>``, started as a multi-site job is: one elastic launcher
(``torchrun``) per facility, inside that facility's namespace, all joining one static
rendezvous at facility 0's link address; gloo binds the facility's link interface, so traffic
between facilities crosses the shaped link and traffic inside one stays on its loopback.

``bench.mode=train`` (default) runs ``bench.configs`` on the same data: the reference
(``bench.reference``, synchronous training) for ``bench.steps`` steps, every other config for
up to ``bench.max_steps_factor`` times as many. Each evaluates every ``bench.eval_every``
steps (after every round). ``time_to_target_seconds`` is the wall time from the start of
training (after start-up, which is the same for every config and reported apart) to the
first evaluation whose loss reaches the reference's final eval loss. The bytes that
crossed are read from the link interfaces' counters (sampled every 50 ms), not computed.
Writes ``wan.json``, ``wan.md`` and ``wan.png`` into its run directory and prints the table.

``bench.mode=hub`` runs facilities behind firewalls: each in a namespace that reaches only the hub's
(``python -m xffl_like.hub serve``), dialling out to it over mutual TLS; a round's time against its bytes at
line rate, TLS's cost against ``--insecure``, a facility and the hub SIGKILLed, a late joiner; see
:mod:`.hub_wan`.

``bench.mode=speeds`` runs facilities of different speeds (issue 21): ``bench.speeds.configs`` as
``train`` runs ``bench.configs`` (same steps, same target, ``bench.reference`` names one of them), with
``bench.speeds.slow`` (``fault.slow_facility=1 fault.slow_factor=2.0``: facility 1 at half speed)
added to every config but the reference (its final eval loss, the target, does not depend on speed) and
``train.eval_every=0`` everywhere (per-facility paces refuse anything else; each round is evaluated
before and after, the synchronous reference every ``federation.every`` steps). A config whose
overrides set ``federation.every=null`` gets ``federation.every_s=bench.speeds.every_s`` or, when that
is null, the median round time of ``bench.speeds.fixed`` measured earlier in the same run (the
interval between its rounds less the exchange: the slower facility's steps and the evaluations), so
its rounds last as long as the fixed ones and the slow facility takes about as many steps. Per config
it reports the steps each facility took per round and each facility's waiting share (the sum of its
``round_records[].waited_s`` over ``train_seconds``), and the goal of issue 21: ``bench.speeds.paced``
reaches the target in <= :data:`GOAL_RATIO` x the time of ``bench.speeds.fixed``, each facility
waiting < :data:`GOAL_WAIT` of its time (:func:`speeds_goal`).

``bench.mode=link`` runs one round of ``bench.link_overrides`` (``model=llama_bench``) and
reports the fraction of the line rate that round achieved (:func:`link_round`), and the window
in which the counters saw the link carry it against the round's own time.

Needs root and iproute2 (``ip``, ``tc``); without them it prints one line and exits 0.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from .. import CONF_DIR
from ..config.checks import is_int, is_number
from .netns import (
    CounterSampler,
    NetnsError,
    Network,
    busy_window,
    cleanup_on_signals,
    launch_torchrun,
    prepare_run_dir,
    tx_at,
    wait_launchers,
)
from .targets import compute_per_step, goal_verdicts, link_ratio, target_figures

__all__ = [
    "WanFailed",
    "eval_curve",
    "time_to_target",
    "loss_at_step",
    "link_round",
    "pace_figures",
    "round_time",
    "speeds_goal",
    "run_wan",
    "format_table",
    "format_speeds",
    "main",
    "GOAL_RATIO",
    "GOAL_WAIT",
]

MODES = ("train", "link", "speeds", "hub")
#: ``bench.mode=speeds``: issue 21's goal, ``bench.speeds.paced``'s time to the target over ``bench.speeds.fixed``'s ...
GOAL_RATIO = 0.75
#: ... and the largest share of its training time any facility of ``paced`` spent waiting at the rounds.
GOAL_WAIT = 0.05


class WanFailed(RuntimeError):
    """The benchmark could not run; ``str(exc)`` is the one line to show."""


# ----------------------------------------------------------------------------- results (pure)
def eval_curve(summary: dict) -> list[tuple[int, float, float]]:
    """``(step, unix time, eval loss)`` of one model the job held, from ``summary["eval_history"]``.

    After a round every facility holds the same (averaged) model: its ``loss_global``. A
    synchronous job holds one model at every step: its ``loss_local``. Between rounds the
    facilities' models differ and no single loss exists, so those points are left out. The
    loss is the mean over facilities weighted by their sizes, as the job's ``eval_loss``.
    """
    sizes = summary["layout"]["facility_sizes"]
    synchronous = summary["federation"]["algorithm"] == "synchronous"
    curve = []
    for entry in summary["eval_history"]:
        losses = entry.get("loss_global") or (entry.get("loss_local") if synchronous else None)
        if losses is not None:
            curve.append((entry["step"], entry["time"], sum(s * x for s, x in zip(sizes, losses)) / sum(sizes)))
    return curve


def time_to_target(curve: list[tuple[int, float, float]], target: float, started: float) -> float | None:
    """Seconds from ``started`` to the first point of ``curve`` whose loss is <= ``target``."""
    for _, when, loss in curve:
        if loss <= target:
            return when - started
    return None


def loss_at_step(curve: list[tuple[int, float, float]], step: int) -> float | None:
    """The curve's loss at ``step`` (the token budget), ``None`` when it has no point there."""
    return next((loss for s, _, loss in curve if s == step), None)


def pace_figures(summary: dict) -> dict:
    """Per facility, from a job's ``summary.json``: ``steps_per_round`` (mean local steps per round:
    ``round_records[].steps_taken`` with per-facility paces, else the job's steps over its rounds),
    ``waited_seconds`` (the sum of ``round_records[].waited_s``: what it waited at the rounds for the
    others), ``waiting_share`` (that over ``train_seconds``) and ``last_round_waiting_share`` (the part
    of it waited at the last round, where with ``every_s`` a facility that reached ``train.steps`` stops
    early). ``None`` each without rounds."""
    records = summary.get("round_records") or []
    facilities = len(summary["layout"]["facility_sizes"])
    if not records:
        return {
            "steps_per_round": None,
            "waited_seconds": None,
            "waiting_share": None,
            "last_round_waiting_share": None,
        }
    if all(r.get("steps_taken") for r in records):
        per_round = [sum(r["steps_taken"][f] for r in records) / len(records) for f in range(facilities)]
    else:
        per_round = [summary["steps"] / len(records)] * facilities
    waits = [r.get("waited_s") or [0.0] * facilities for r in records]
    waited = [sum(w[f] for w in waits) for f in range(facilities)]
    return {
        "steps_per_round": per_round,
        "waited_seconds": waited,
        "waiting_share": [w / summary["train_seconds"] for w in waited],
        "last_round_waiting_share": [w / summary["train_seconds"] for w in waits[-1]],
    }


def round_time(curve_seconds: list[float], aggregation_seconds: list[float]) -> float | None:
    """``federation.every_s`` that makes rounds as long as those of a job whose rounds were evaluated at
    ``curve_seconds`` (seconds since the start of training, one per round) and whose exchanges took
    ``aggregation_seconds``: the median interval between rounds (the first from the start) less the
    median exchange, which ``every_s`` does not count. ``None`` without rounds."""
    if not curve_seconds or not aggregation_seconds:
        return None
    intervals = [b - a for a, b in zip([0.0, *curve_seconds], curve_seconds)]
    return max(_median(intervals) - _median(aggregation_seconds), 1e-3)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def speeds_goal(results: dict, fixed: str, paced: str) -> dict:
    """Issue 21's goal from the ``results`` of ``bench.mode=speeds``: ``paced``'s time to the target over
    ``fixed``'s (``ratio``, goal <= :data:`GOAL_RATIO`) and the largest waiting share of any facility
    of ``paced`` (``max_waiting_share``, goal < :data:`GOAL_WAIT`); ``met`` is ``None`` when a figure is
    missing (a config failed or never reached the target)."""
    f, p = results.get(fixed) or {}, results.get(paced) or {}
    tf, tp = f.get("time_to_target_seconds"), p.get("time_to_target_seconds")
    ratio = tp / tf if tp is not None and tf else None
    shares = p.get("waiting_share")
    wait = max(shares) if shares else None
    met = None if ratio is None or wait is None else ratio <= GOAL_RATIO and wait < GOAL_WAIT
    return {
        "fixed": fixed,
        "paced": paced,
        "fixed_seconds": tf,
        "paced_seconds": tp,
        "ratio": ratio,
        "max_waiting_share": wait,
        "met": met,
        "goal": f"ratio <= {GOAL_RATIO}, every facility waiting < {GOAL_WAIT:.0%} of its training time",
    }


# ----------------------------------------------------------------------------- validation
def _check(plain: dict) -> dict:
    bench = plain["bench"]

    def positive(key, kind=int):
        value = bench.get(key)
        if not (is_number(value) if kind is float else is_int(value)) or value <= 0:
            raise WanFailed(f"bench.{key}={value!r}: must be a positive {'number' if kind is float else 'integer'}")

    if bench.get("mode") not in MODES:
        raise WanFailed(f"bench.mode={bench.get('mode')!r}: use one of {list(MODES)}")
    for key in ("facilities", "nproc_per_facility", "steps", "eval_every"):
        positive(key)
    for key in ("link_mbit", "timeout_s", "max_steps_factor"):
        positive(key, float)
    if bench["facilities"] < 2:
        raise WanFailed(f"bench.facilities={bench['facilities']}: a wide-area link needs at least 2 facilities")
    if bench["max_steps_factor"] < 1:
        raise WanFailed(f"bench.max_steps_factor={bench['max_steps_factor']}: must be >= 1")
    key = "bench.speeds.configs" if bench["mode"] == "speeds" else "bench.configs"
    configs = (bench.get("speeds") or {}).get("configs") if bench["mode"] == "speeds" else bench.get("configs")
    if not isinstance(configs, dict) or not configs:
        raise WanFailed(
            f"{key} must map config names to lists of overrides, e.g. {{synchronous: [+experiment=synchronous]}}"
        )
    if bench["mode"] == "hub":
        return bench
    if bench["mode"] in ("train", "speeds") and bench.get("reference") not in configs:
        raise WanFailed(f"bench.reference={bench.get('reference')!r}: name one of {key} {list(configs)}")
    for name, overrides in {**configs, "link_overrides": bench.get("link_overrides")}.items():
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            where = "bench.link_overrides" if name == "link_overrides" else f"{key}.{name}"
            raise WanFailed(f"{where}={overrides!r}: must be a list of override strings")
    if bench["mode"] == "speeds":
        _check_speeds(bench["speeds"], bench["reference"])
    goals = bench.get("goal_configs") or []
    if not isinstance(goals, list) or any(name not in (bench.get("configs") or {}) for name in goals):
        raise WanFailed(f"bench.goal_configs={goals!r}: a list of names of bench.configs {list(bench.get('configs'))}")
    topk = bench.get("link_topk")
    if topk is not None and (not isinstance(topk, list) or not all(isinstance(o, str) for o in topk)):
        raise WanFailed(f"bench.link_topk={topk!r}: a list of override strings, or null")
    return bench


def _check_speeds(speeds: dict, reference: str) -> None:
    configs = speeds["configs"]
    for key in ("slow", "overrides"):
        value = speeds.get(key)
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise WanFailed(f"bench.speeds.{key}={value!r}: must be a list of override strings")
    every_s = speeds.get("every_s")
    if every_s is not None and (not is_number(every_s) or not 0 < every_s < float("inf")):
        raise WanFailed(
            f"bench.speeds.every_s={every_s!r}: a number of seconds, or null (measured from bench.speeds.fixed)"
        )
    for key in ("fixed", "paced"):
        if speeds.get(key) not in configs:
            raise WanFailed(f"bench.speeds.{key}={speeds.get(key)!r}: name one of bench.speeds.configs {list(configs)}")
    if speeds["fixed"] in (speeds["paced"], reference):
        raise WanFailed(
            f"bench.speeds.fixed={speeds['fixed']!r}: the goal compares it with bench.speeds.paced; name "
            f"another config than that and bench.reference"
        )
    timed = [name for name, overrides in configs.items() if _timed(overrides)]
    if every_s is None and timed:
        order = list(configs)
        if speeds["fixed"] in timed or any(order.index(n) < order.index(speeds["fixed"]) for n in timed):
            raise WanFailed(
                f"bench.speeds.every_s=null takes federation.every_s from bench.speeds.fixed="
                f"{speeds['fixed']!r}, which must have rounds of fixed steps and come before {timed} in "
                f"bench.speeds.configs; or set bench.speeds.every_s"
            )


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _timed(overrides: list[str]) -> bool:
    """Whether a ``bench.speeds`` config's rounds are bounded by time: it sets ``federation.every=null``
    and leaves ``federation.every_s`` to the bench."""
    keys = {_override_key(o): o.split("=", 1)[1] if "=" in o else None for o in overrides}
    return keys.get("federation.every") == "null" and "federation.every_s" not in keys


def _runs(bench: dict) -> dict[str, list[str]]:
    """Config name -> the main job's overrides, the bench's own settings last (they win)."""
    world = bench["facilities"] * bench["nproc_per_facility"]
    fixed = [
        f"distributed.nproc_per_node={world}",
        f"distributed.federated={bench['nproc_per_facility']}",
        "distributed.hsdp=null",
    ]
    if bench["mode"] == "link":
        one_round = [*bench["common"], *bench["link_overrides"], *fixed, "train.steps=1", "federation.every=1"]
        one_round.append("optim.warmup_steps=1")  # one step: no warm-up to reach the lr in
        topk = bench.get("link_topk")
        return {"link": one_round, **({"link_topk": [*one_round, *topk]} if topk else {})}
    runs = {}
    if bench["mode"] == "speeds":
        speeds = bench["speeds"]
        for name, overrides in speeds["configs"].items():
            reference = name == bench["reference"]
            steps = bench["steps"] if reference else int(bench["steps"] * bench["max_steps_factor"])
            # every_s null: 1 s stands in while the configs are validated; the measured value replaces it.
            timed = [f"federation.every_s={speeds['every_s'] or 1.0:g}"] if _timed(overrides) else []
            runs[name] = [
                *bench["common"],
                *speeds["overrides"],
                *overrides,
                *([] if reference else speeds["slow"]),
                *timed,
                *fixed,
                f"train.steps={steps}",
                "train.eval_every=0",
            ]
        return runs
    for name, overrides in bench["configs"].items():
        steps = bench["steps"] if name == bench["reference"] else int(bench["steps"] * bench["max_steps_factor"])
        runs[name] = [
            *bench["common"],
            *overrides,
            *fixed,
            f"train.steps={steps}",
            f"train.eval_every={bench['eval_every']}",
        ]
    return runs


def _set_every_s(overrides: list[str], every_s: float) -> list[str]:
    """``overrides`` with ``federation.every_s`` set to ``every_s`` (measured)."""
    return [f"federation.every_s={every_s:.3f}" if _override_key(o) == "federation.every_s" else o for o in overrides]


def _validate_runs(runs: dict[str, list[str]], bench: dict) -> None:
    """Compose and validate every run's config here, before any namespace exists."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.initialize import get_gh_backup, restore_gh_from_backup

    world = bench["facilities"] * bench["nproc_per_facility"]
    backup = get_gh_backup()  # this process runs a Hydra app already: compose beside it, then restore it
    try:
        for name, overrides in runs.items():
            GlobalHydra.instance().clear()
            _validate_run(name, overrides, world, bench)
    finally:
        restore_gh_from_backup(backup)


def _validate_run(name: str, overrides: list[str], world: int, bench: dict) -> None:
    from ..config.validate import ConfigError, validate_config
    from ..job import _compose, choices, resolve

    try:
        composed = _compose(overrides)
        plain = resolve(composed)
        validate_config(plain, world, bench["nproc_per_facility"], Path.cwd(), choices(composed))
    except ConfigError as exc:
        raise WanFailed(f"config {name}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - Hydra's compose errors: one line
        raise WanFailed(f"config {name}: {str(exc).splitlines()[0]}") from None
    every = plain["train"]["eval_every"]
    if bench["mode"] != "link" and every and plain["train"]["steps"] % every:
        raise WanFailed(
            f"config {name}: train.steps={plain['train']['steps']} is not a multiple of "
            f"bench.eval_every={bench['eval_every']}"
        )


# ----------------------------------------------------------------------------- one run
def _last_error(run_dir: Path) -> str:
    for f in sorted(run_dir.glob("facility*.log")):
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if ln.startswith("error")]
        if lines:
            return lines[0]
    return f"see {run_dir}/facility*.log"


def _measure(name: str, run_dir: Path, started: float, ended: float, sampler: CounterSampler, bench: dict) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    curve = eval_curve(summary)
    t0 = summary["train_started_at"]
    train_end = curve[-1][1] if curve else ended
    # Bytes from the start of training to the last evaluation (start-up and the job's final
    # checks after it are left out), and over the whole run.
    sent = sampler.tx_between(t0, train_end)
    rate = bench["link_mbit"] * 1e6 / 8
    out = {
        "wall_seconds": ended - started,
        "startup_seconds": t0 - started,
        "train_seconds": summary["train_seconds"],
        "steps": summary["steps"],
        "rounds": summary["rounds"],
        "cross_bytes": int(sum(sent)),
        "cross_bytes_per_facility": [int(b) for b in sent],
        "cross_bytes_whole_run": int(sum(sampler.tx_between(started, ended))),
        "cross_bytes_computed": sum(summary["cross_facility_bytes_per_round"]),
        # Mean over facilities of (bytes sent / what the uplink could carry while training ran).
        "link_utilization": sum(sent) / len(sent) / (rate * (train_end - t0)),
        # Seconds since the start of training (the same start-up precedes every config), bytes across since then.
        "eval_curve": [
            {"step": s, "seconds": t - t0, "loss": loss, "cross_bytes": int(sum(sampler.tx_between(t0, t)))}
            for s, t, loss in curve
        ],
        "compute_seconds_per_step": compute_per_step(summary),
        "eval_loss_end": summary["eval_loss"],
        "run_dir": str(run_dir),
    }
    if summary["rounds"]:
        out["cross_bytes_per_round"] = out["cross_bytes"] / summary["rounds"]
    if bench["mode"] == "speeds":
        facilities = len(summary["layout"]["facility_sizes"])
        out["every_s"] = summary["federation"].get("every_s")
        out["facility_steps"] = summary.get("facility_steps") or [summary["steps"]] * facilities
        out.update(pace_figures(summary))
        # federation.every_s whose rounds would last as long as this config's (bench.speeds.every_s=null)
        out["matching_every_s"] = round_time(
            [p["seconds"] for p in out["eval_curve"]] if summary["rounds"] else [], summary["aggregation_seconds"]
        )
    if bench["mode"] == "link":
        out.update(link_round(summary["aggregation_seconds"][0], sampler.samples, t0, train_end, rate))
        out["round_bytes_computed"] = summary["cross_facility_bytes_per_round"][0]
    return out


def link_round(round_seconds: float, samples: list[tuple[float, list[int]]], t0: float, t1: float, rate: float) -> dict:
    """``bench.mode=link``: the one round between ``t0`` and ``t1`` (the start of training and the
    evaluation after the round) against the counters ``samples``, ``rate`` in bytes/s.

    ``transfer_seconds``: the window in which the link carried the round (:func:`~.netns.busy_window`).
    ``link_utilization``: mean over facilities of the bytes counted on its interface / (line rate x
    the longer of the round's time in the job (``round_seconds``, the slowest rank's) and the
    transfer window): a time that contains the whole exchange, as the job and as the wire saw it.
    ``transfer_utilization``: the same bytes over the transfer window alone (how well the link
    was used while it was in use); ``round_overhead_seconds``: the round's time outside it."""
    sent = [y - x for x, y in zip(tx_at(samples, t0), tx_at(samples, t1))]
    per_facility = sum(sent) / len(sent)
    window = busy_window(samples, t0, t1, rate)
    transfer = window[1] - window[0] if window else 0.0
    return {
        "round_seconds": round_seconds,
        "transfer_seconds": transfer,
        "transfer_window": list(window) if window else None,
        "round_overhead_seconds": round_seconds - transfer,
        "link_utilization": per_facility / (rate * max(round_seconds, transfer)),
        "transfer_utilization": per_facility / (rate * transfer) if transfer else None,
    }


# ----------------------------------------------------------------------------- the benchmark
def _paced_overrides(
    name: str, overrides: list[str], bench: dict, results: dict
) -> tuple[list[str] | None, str | None]:
    """``name``'s overrides, or ``None`` and why it cannot run. In speeds mode without ``bench.speeds.every_s``,
    a timed config gets the ``federation.every_s`` that matches the fixed config's rounds (run before it)."""
    speeds = bench["speeds"] if bench["mode"] == "speeds" else None
    if speeds is None or speeds["every_s"] is not None or not _timed(speeds["configs"][name]):
        return overrides, None
    every_s = (results.get(speeds["fixed"]) or {}).get("matching_every_s")
    if every_s is None:
        return None, (
            f"no federation.every_s: bench.speeds.fixed={speeds['fixed']} did "
            f"not finish with rounds; set bench.speeds.every_s"
        )
    return _set_every_s(overrides, every_s), None


def _run_config(
    index: int, name: str, overrides: list[str], network: Network, sampler: CounterSampler, bench: dict, job_dir: Path
) -> tuple[dict | None, str | None]:
    """Run one config under torchrun in every facility's namespace; its measurements, or ``None`` and why it failed."""
    print(f"[{name}] {' '.join(overrides)}", flush=True)
    started = time.time()
    env = {
        "XFFL_RUN_DIR": str(job_dir.resolve()),
        "WANDB_MODE": "offline",
        "OMP_NUM_THREADS": str(bench["threads_per_process"]),
    }
    pin = bench["mode"] == "speeds" and bool(bench["speeds"].get("pin"))
    procs = launch_torchrun(
        network,
        bench["nproc_per_facility"],
        ["-m", "xffl_like.run", *overrides],
        env,
        job_dir,
        29500 + index,
        pin=pin,
    )
    failed = wait_launchers(procs, network, bench["timeout_s"])
    ended = time.time()
    if failed:
        return None, f"{failed}: {_last_error(job_dir)}"
    try:
        result = _measure(name, job_dir, started, ended, sampler, bench)
    except NetnsError as exc:
        return None, str(exc)
    print(f"[{name}] {ended - started:.1f} s", flush=True)
    return result, None


def _write_report(run_dir: Path, bench: dict, results: dict, failures: dict, network: Network, sampler) -> dict:
    """Write ``wan.json``, ``counters.json``, ``wan.md`` and (train and speeds modes) ``wan.png``; return the report."""
    report = _report(bench, results, failures)
    report["tcp"] = network.tcp
    (run_dir / "wan.json").write_text(json.dumps(report, indent=2) + "\n")
    (run_dir / "counters.json").write_text(
        json.dumps({"interfaces": [f.interface for f in network.facilities], "samples": sampler.samples}) + "\n"
    )
    (run_dir / "wan.md").write_text(format_table(report) + "\n")
    if bench["mode"] in ("train", "speeds"):
        from ..observe.plots import plot_eval_curves

        note = plot_eval_curves(
            {n: r["eval_curve"] for n, r in results.items()},
            report.get("target_eval_loss"),
            bench["link_mbit"],
            run_dir / "wan.png",
        )
        if note:
            print(f"note: {note}")
    return report


def run_wan(cfg: DictConfig, run_dir: Path) -> dict | None:
    """Validate, build the network, run every config, write ``wan.json``; ``None`` when
    namespaces cannot be made here (the reason is printed)."""
    plain = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    plain.pop("hydra", None)
    bench = _check(plain)
    if bench["mode"] == "hub":
        from .hub_wan import check_hub, run_hub_mode

        wrong = check_hub(bench)
        if wrong:
            raise WanFailed(wrong)
        return run_hub_mode(plain, bench, run_dir)
    runs = _runs(bench)
    _validate_runs(runs, bench)
    if not prepare_run_dir(plain, run_dir):
        return None
    results, failures = {}, {}
    with cleanup_on_signals():
        try:
            network = Network(bench["facilities"], bench["link_mbit"])
        except NetnsError as exc:
            print(f"bench.wan skipped: cannot build network namespaces here: {exc}", flush=True)
            return None
        with network, CounterSampler(network) as sampler:
            for i, (name, overrides) in enumerate(runs.items()):
                overrides, why = _paced_overrides(name, overrides, bench, results)
                if overrides is not None:
                    result, why = _run_config(i, name, overrides, network, sampler, bench, run_dir / "runs" / name)
                if why is not None:
                    failures[name] = why
                    print(f"[{name}] failed: {why}", flush=True)
                    continue
                results[name] = result
    return _write_report(run_dir, bench, results, failures, network, sampler)


def _report(bench: dict, results: dict, failures: dict) -> dict:
    report = {
        "mode": bench["mode"],
        "link_mbit": bench["link_mbit"],
        "facilities": bench["facilities"],
        "nproc_per_facility": bench["nproc_per_facility"],
        "results": results,
        "failures": failures,
    }
    if bench["mode"] == "link":
        report["link_ratio"] = link_ratio(results)
        return report
    ref = results.get(bench["reference"])
    report["reference"] = bench["reference"]
    report["steps"] = bench["steps"]
    report["target_eval_loss"] = ref["eval_curve"][-1]["loss"] if ref else None
    ref_time = None
    if ref:
        ref_time = next(p["seconds"] for p in ref["eval_curve"] if p["loss"] <= report["target_eval_loss"])
    for _name, r in results.items():
        curve = [(p["step"], p["seconds"], p["loss"]) for p in r["eval_curve"]]
        r["final_eval_loss"] = loss_at_step(curve, bench["steps"])
        ttt = time_to_target(curve, report["target_eval_loss"], 0.0) if ref else None
        r["time_to_target_seconds"] = ttt
        r["time_to_target_ratio"] = ttt / ref_time if ttt is not None and ref_time else None
    target_figures(results, bench["reference"], report["target_eval_loss"])
    if bench["mode"] == "train":
        report["goals"] = goal_verdicts(results, bench.get("goal_configs") or [])
    if bench["mode"] == "speeds":
        speeds = bench["speeds"]
        report["speeds"] = {k: speeds[k] for k in ("slow", "overrides", "every_s", "fixed", "paced")}
        fixed_time = (results.get(speeds["fixed"]) or {}).get("time_to_target_seconds")
        for r in results.values():
            ttt = r["time_to_target_seconds"]
            r["time_to_target_x_fixed"] = ttt / fixed_time if ttt is not None and fixed_time else None
        report["goal"] = speeds_goal(results, speeds["fixed"], speeds["paced"])
    return report


def format_table(report: dict) -> str:
    """The results as a markdown table (also printed)."""
    if report["mode"] == "hub":
        from .hub_wan import format_hub

        return format_hub(report)
    if report["mode"] == "link":
        r = report["results"].get("link")
        if r is None:
            return f"link mode failed: {report['failures']}"
        return (
            f"one round over {report['link_mbit']:g} Mbit/s: {r['round_seconds']:.2f} s, "
            f"{r['cross_bytes'] / 1e6:.1f} MB crossed (counters; computed {r['round_bytes_computed'] / 1e6:.1f} MB), "
            f"{100 * r['link_utilization']:.1f}% of the line rate; the link carried it in "
            f"{r['transfer_seconds']:.2f} s ({100 * (r['transfer_utilization'] or 0):.1f}% of the line rate then), "
            f"{r['round_overhead_seconds']:.2f} s of the round outside that"
            + _format_link_ratio(report.get("link_ratio"))
        )
    if report["mode"] == "speeds":
        return format_speeds(report)
    head = (
        "| config | steps | rounds | wall s | final eval loss | time to target s | x reference | "
        "cross MB | MB per round | link use | steps to target (x ref) | bytes to target x ref | overhead | "
        "overhead, whole run |"
    )
    lines = [
        f"{report['facilities']} facilities x {report['nproc_per_facility']} processes, link "
        f"{report['link_mbit']:g} Mbit/s each way; target eval loss {report['target_eval_loss']} "
        f"({report['reference']}'s final, step {report['steps']})",
        "",
        head,
        "|" + "---|" * 14,
    ]
    for name, r in report["results"].items():

        def fmt(v, spec):
            return "-" if v is None else format(v, spec)

        lines.append(
            f"| {name} | {r['steps']} | {r['rounds']} | {r['wall_seconds']:.1f} | {fmt(r['final_eval_loss'], '.4f')} | "
            f"{fmt(r['time_to_target_seconds'], '.1f')} | {fmt(r['time_to_target_ratio'], '.3f')} | "
            f"{r['cross_bytes'] / 1e6:.2f} | "
            f"{fmt(r.get('cross_bytes_per_round') and r['cross_bytes_per_round'] / 1e6, '.3f')} | "
            f"{r['link_utilization']:.2f} | {fmt(r.get('steps_to_target'), 'd')} "
            f"({fmt(r.get('steps_to_target_ratio'), '.3f')}) | {fmt(r.get('bytes_to_target_fraction'), '.2e')} | "
            f"{fmt(r.get('overhead'), '.3f')} | {fmt(r.get('overhead_run'), '.3f')} |"
        )
    lines += _format_goals(report.get("goals") or {})
    for name, why in report["failures"].items():
        lines.append(f"failed: {name}: {why}")
    return "\n".join(lines)


_VERDICT = {True: "met", False: "not met", None: "not measured"}


def _format_goals(goals: dict) -> list[str]:
    """Issue 29's goals per config (bench.goal_configs): value, bound, met or not."""
    if not goals:
        return []
    lines = ["", "goals (issue 29): bytes to target <= 1/1000 of the reference's, overhead <= 1.05, steps <= 1.15x"]
    for name, figures in goals.items():
        parts = [
            f"{key} {'-' if v['value'] is None else format(v['value'], '.4g')} (<= {v['goal']:.4g}): "
            f"{_VERDICT[v['met']]}"
            for key, v in figures.items()
        ]
        lines.append(f"- {name}: " + "; ".join(parts))
    return lines


def _format_link_ratio(ratio: dict | None) -> str:
    if not ratio or ratio["ratio"] is None:
        return ""
    return (
        f"; a top-k round moved {ratio['ratio']:.4f} of the fp32 round's bytes (1/{1 / ratio['ratio']:.0f}; "
        f"goal <= 1/{1 / ratio['goal']:.0f}): {_VERDICT[ratio['met']]}"
    )


def format_speeds(report: dict) -> str:
    """``bench.mode=speeds``: every config side by side, then issue 21's goal (met / not met)."""

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    def per_facility(values, spec):
        return "-" if values is None else " / ".join(format(v, spec) for v in values)

    speeds, goal = report["speeds"], report["goal"]
    lines = [
        f"{report['facilities']} facilities x {report['nproc_per_facility']} processes, link "
        f"{report['link_mbit']:g} Mbit/s each way; {' '.join(speeds['slow'])} in every config but "
        f"{report['reference']}; target eval loss {fmt(report['target_eval_loss'], '.4f')} "
        f"({report['reference']}'s final, step {report['steps']})",
        "",
        "| config | steps per facility | rounds | steps per round | every_s | wall s | train s | eval loss at end | "
        "time to target s | x reference | x fixed | waiting share per facility | of which at the last round |",
        "|" + "---|" * 13,
    ]
    for name, r in report["results"].items():
        end = r["eval_curve"][-1]["loss"] if r["eval_curve"] else None
        lines.append(
            f"| {name} | {per_facility(r['facility_steps'], 'd')} | {r['rounds']} | "
            f"{per_facility(r['steps_per_round'], '.1f')} | {fmt(r['every_s'], '.2f')} | {r['wall_seconds']:.1f} | "
            f"{r['train_seconds']:.1f} | {fmt(end, '.4f')} | {fmt(r['time_to_target_seconds'], '.1f')} | "
            f"{fmt(r['time_to_target_ratio'], '.3f')} | {fmt(r['time_to_target_x_fixed'], '.3f')} | "
            f"{per_facility(r['waiting_share'], '.1%')} | {per_facility(r['last_round_waiting_share'], '.1%')} |"
        )
    verdict = {True: "met", False: "not met", None: "not measured"}[goal["met"]]
    lines += [
        "",
        f"goal: {goal['paced']} reaches the target in <= {GOAL_RATIO}x the wall time of {goal['fixed']}, each "
        f"facility waiting < {GOAL_WAIT:.0%} of its time: {fmt(goal['ratio'], '.3f')}x "
        f"({fmt(goal['paced_seconds'], '.1f')} s / {fmt(goal['fixed_seconds'], '.1f')} s), most waiting "
        f"{fmt(goal['max_waiting_share'] and 100 * goal['max_waiting_share'], '.1f')}%: {verdict}",
    ]
    for name, why in report["failures"].items():
        lines.append(f"failed: {name}: {why}")
    return "\n".join(lines)


@hydra.main(config_path=str(CONF_DIR), config_name="bench_wan", version_base=None)
def main(cfg: DictConfig) -> dict | None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        report = run_wan(cfg, run_dir)
    except WanFailed as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted: the runs were stopped and the namespaces removed", file=sys.stderr, flush=True)
        sys.exit(130)
    if report is None:
        return None
    print(format_table(report))
    print(f"wrote {run_dir / 'wan.json'}")
    if report["failures"]:
        sys.exit(1)
    return report


if __name__ == "__main__":
    main()
