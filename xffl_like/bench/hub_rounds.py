"""``bench.mode=hub``, round by round: what each round moved over each facility's link and the hub's, and how
long it took against those bytes at line rate.

:class:`LinkSampler` reads every facility's interface counters (bytes sent, received: Ethernet frames,
headers included) every :data:`INTERVAL_S` in a thread. A round's window (:func:`round_windows`) runs from the
moment the last facility held the previous version's result to the moment the last facility held this one's
(seen in the facilities' ``aggregation.csv``): its uploads and its downloads fall inside (the first round's
window also holds the creation and the joins). Per round (:func:`round_rows`): each facility's bytes up and
down, the hub's egress (the sum of the facilities' downloads: every byte the hub sent), the round's time (the
least recorded round seconds of its accepted facilities) over the time the slowest facility's bytes need at
its line rate (up at ``up_mbit``, then down at ``down_mbit``), and the hub's own time from the round's last
upload to the first byte of its result (its log's :data:`xffl_like.hub.server.latency.LINE`).
"""

from __future__ import annotations

import re
import statistics
import threading
import time

__all__ = [
    "GOAL_BYTES",
    "INTERVAL_S",
    "LinkSampler",
    "accepted_by_version",
    "at",
    "bytes_figure",
    "format_rounds",
    "hub_latencies",
    "round_rows",
    "round_windows",
    "rounds_figure",
    "rounds_goal",
]

INTERVAL_S = 0.1
#: Issue 37: with top-k through the hub, a facility's bytes per round (up + down) over an fp32 round's payload.
GOAL_BYTES = 1 / 50


def rounds_goal(facilities: int) -> float:
    """Issue 37's goal for a round against its bytes at line rate: 1.2 x with two facilities, 1.5 x with more."""
    return 1.2 if facilities <= 2 else 1.5


_LATENCY = re.compile(
    r"hub: round (\d+) \(version (\d+)\): ([\d.]+) s from the last upload's end to the first byte of its result "
    r"\(round ([\d.]+) s\)"
)


class LinkSampler:
    """``counters()`` (per facility ``(sent, received)``) every ``interval_s`` in a thread, into
    :attr:`samples` ``(time, [(sent, received), ...])``; a reading that fails ends the series (:attr:`error`)."""

    def __init__(self, counters, interval_s: float = INTERVAL_S):
        self.counters, self.interval_s = counters, interval_s
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="hub-wan-links")

    def _loop(self) -> None:
        try:
            while True:
                self.samples.append((time.time(), [tuple(c) for c in self.counters()]))
                if self._stop.wait(self.interval_s):
                    self.samples.append((time.time(), [tuple(c) for c in self.counters()]))
                    return
        except Exception as exc:  # noqa: BLE001 - the network went away: the series ends here
            self.error = f"counters unreadable: {exc}"

    def __enter__(self) -> LinkSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def at(samples: list[tuple[float, list[tuple[int, int]]]], t: float) -> list[tuple[float, float]]:
    """Every facility's ``(sent, received)`` at ``t``, linear between samples, clamped to the first and last."""
    if not samples:
        raise ValueError("no counter samples")
    if t <= samples[0][0]:
        return [(float(a), float(b)) for a, b in samples[0][1]]
    for (ta, va), (tb, vb) in zip(samples, samples[1:]):
        if t <= tb:
            w = 0.0 if tb == ta else (t - ta) / (tb - ta)
            return [(x[0] + w * (y[0] - x[0]), x[1] + w * (y[1] - x[1])) for x, y in zip(va, vb)]
    return [(float(a), float(b)) for a, b in samples[-1][1]]


def round_windows(held: dict[str, list[tuple[float, int]]], start: float) -> dict[int, tuple[float, float]]:
    """version -> ``(start, end)``: from the last facility holding the previous version (``start`` for the
    first) to the last holding this one. ``held``: per facility, ``(time, version)`` of each result it held."""
    last: dict[int, float] = {}
    for results in held.values():
        for t, v in results:
            last[v] = max(last.get(v, t), t)
    out, begin = {}, start
    for v in sorted(last):
        out[v] = (begin, last[v])
        begin = last[v]
    return out


def hub_latencies(log: str) -> dict[int, tuple[float, float]]:
    """version -> (seconds from the round's last upload to its result's first byte, the round's seconds at the
    hub), from the hub's log."""
    return {int(m[2]): (float(m[3]), float(m[4])) for m in _LATENCY.finditer(log)}


def accepted_by_version(records: dict[str, list[dict]]) -> dict[int, list[str]]:
    """version -> the facilities whose contribution it accepted, by their records."""
    out: dict[int, list[str]] = {}
    for name, recs in sorted(records.items()):
        for r in recs:
            if r.get("status") == "accepted" and r.get("round") is not None:
                out.setdefault(int(r["round"]) + 1, []).append(name)
    return out


def round_rows(samples, windows: dict, times: dict[int, float], latencies: dict, up_mbit: float, down_mbit: float,
               accepted: dict[int, list[str]] | None = None):  # fmt: skip
    """One row per version with a window: each facility's bytes up and down in it, the hub's egress, the
    round's time (``times``, None if no accepted record has it) over its slowest facility's bytes at line rate,
    the hub's latency (``latencies``, :func:`hub_latencies`) and the facilities it accepted (``accepted``)."""
    rows, accepted = [], accepted or {}
    for v, (t0, t1) in sorted(windows.items()):
        a, b = at(samples, t0), at(samples, t1)
        up = [y[0] - x[0] for x, y in zip(a, b)]
        down = [y[1] - x[1] for x, y in zip(a, b)]
        line = max(u * 8 / (up_mbit * 1e6) + d * 8 / (down_mbit * 1e6) for u, d in zip(up, down))
        seconds = times.get(v)
        lat = latencies.get(v)
        rows.append({
            "version": v,
            "window": [t0, t1],
            "up": up,
            "down": down,
            "hub_egress": sum(down),
            "seconds": seconds,
            "line_seconds": line,
            "ratio": seconds / line if seconds is not None and line > 0 else None,
            "hub_latency_s": lat[0] if lat else None,
            "hub_round_s": lat[1] if lat else None,
            "accepted": accepted.get(v, []),
        })  # fmt: skip
    return rows


def rounds_figure(rows: list[dict], facilities: int) -> dict | None:
    """The median round against line rate, the hub's egress and its latency, over the rounds that accepted every
    one of the ``facilities`` (the first left out: it carries the creation and the joins); None without one."""
    later = [r for r in rows[1:] if r["ratio"] is not None and len(r.get("accepted", [])) == facilities]
    if not later:
        return None
    lat = [r["hub_latency_s"] for r in later if r["hub_latency_s"] is not None]
    share = [r["hub_latency_s"] / r["seconds"] for r in later if r["hub_latency_s"] is not None and r["seconds"]]
    return {
        "rounds": len(later),
        "versions": [r["version"] for r in later],
        "ratio": statistics.median(r["ratio"] for r in later),
        "max_ratio": max(r["ratio"] for r in later),
        "seconds": statistics.median(r["seconds"] for r in later),
        "line_seconds": statistics.median(r["line_seconds"] for r in later),
        "hub_egress": statistics.median(r["hub_egress"] for r in later),
        "facility_bytes": statistics.median(max(u + d for u, d in zip(r["up"], r["down"])) for r in later),
        "hub_latency_s": statistics.median(lat) if lat else None,
        "hub_latency_share": statistics.median(share) if share else None,
    }


def bytes_figure(fig: dict, numel: int) -> dict:
    """A facility's bytes per round (the most of any facility, median round; link bytes) over an fp32 round's
    payload (4 x numel up and down): issue 37's goal for top-k, :data:`GOAL_BYTES`."""
    fp32 = 8 * numel
    return {"bytes": fig["facility_bytes"], "fp32_bytes": fp32, "ratio": fig["facility_bytes"] / fp32,
            "goal": GOAL_BYTES}  # fmt: skip


def _mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:.2f}"


def _s(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def format_rounds(rows: list[dict], names: list[str]) -> list[str]:
    """The rounds as a markdown table (bytes in MB, link counters)."""
    lines = [
        "| version | accepted | round s | its bytes at line rate s | ratio | hub: last upload -> first result byte "
        "s (round s at the hub) | hub egress MB | up/down MB per facility |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        each = ", ".join(f"{n} {_mb(u)}/{_mb(d)}" for n, u, d in zip(names, r["up"], r["down"]))
        lines.append(
            f"| {r['version']}{' (joins)' if r is rows[0] else ''} | {len(r.get('accepted', []))} | "
            f"{_s(r['seconds'])} | {r['line_seconds']:.2f} | "
            f"{_s(r['ratio'])} | {_s(r['hub_latency_s'], '.3f')} ({_s(r['hub_round_s'])}) | "
            f"{_mb(r['hub_egress'])} | {each} |"
        )
    return lines
