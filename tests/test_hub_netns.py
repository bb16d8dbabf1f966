"""Facilities behind firewalls: each in a network namespace that reaches only the hub's (no route between
facilities, forwarding off in the hub's namespace), completing their rounds through the hub over mutual TLS.

The test checks the isolation itself (a TCP connect from facility a's namespace to a listener at facility b's
address fails, even with a route through the hub, while the hub's namespace reaches it), that the facilities
listen on loopback only (``ss -ltnp`` in each facility's namespace while they run), and every round's values
from what each leader dumps ($XFFL_TEST_DUMP_ROUNDS): θ_global after a round is the mean of the two
facilities' parameters before it (computed here) and both hold it bit for bit. Also: the figures'
arithmetic of ``bench.mode=hub`` (:mod:`xffl_like.bench.hub_wan`), pure functions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import PLUGINS, REPO, TINY

from xffl_like.bench import hub_wan, netns


def _why_not() -> str | None:
    why = netns.unavailable()
    if why is None:
        try:
            subprocess.run(["ip", "netns", "list"], capture_output=True, check=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            why = "`ip netns` is unavailable here"
    return why


WHY = _why_not()
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
EVERY, STEPS = 1, 2  # versions 1 and 2
NAMES = ("a", "b")
# The hub's fp32 mean against the float64 one here, values of magnitude <= ~1.
ATOL = 1e-6

CONNECT = """
import socket, sys
s = socket.socket()
s.settimeout(float(sys.argv[3]))
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("connected")
except OSError as exc:
    print(f"failed {type(exc).__name__} {exc.errno}")
"""
LISTEN = """
import socket, sys
srv = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    srv.accept()[0].close()
"""


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def _connect(net: netns.HubNetwork, where, host: str, port: int, timeout: float = 2.0) -> str:
    return net.run(where, [sys.executable, "-c", CONNECT, host, str(port), str(timeout)], timeout=30).stdout.strip()


def _check_isolation(net: netns.HubNetwork) -> None:
    """A listener at b's address: the hub's namespace reaches it, a's does not (no route; and with a route
    through the hub, its namespace does not forward)."""
    b = net.facilities[1].address
    listener = net.popen(1, [sys.executable, "-c", LISTEN, "7001"], stdout=subprocess.PIPE, text=True)
    try:
        assert listener.stdout.readline().strip() == "ready"
        assert _connect(net, "hub", b, 7001) == "connected"  # the listener works
        assert _connect(net, 0, b, 7001).startswith("failed"), "facility a reached facility b"
        via = net.hub_address(0)
        net.run(0, ["ip", "route", "add", f"{netns.HUB_SUBNET}.1.0/24", "via", via])
        assert f"via {via}" in net.run(0, ["ip", "route"]).stdout
        assert _connect(net, 0, b, 7001).startswith("failed"), "the hub's namespace forwarded a to b"
        assert net.run("hub", ["cat", "/proc/sys/net/ipv4/ip_forward"]).stdout.strip() == "0"
    finally:
        listener.kill()
        listener.wait(timeout=10)


_LOOPBACK = re.compile(r"^(127\.\d+\.\d+\.\d+|\[::1\]|\[::ffff:127\.\d+\.\d+\.\d+\]):\d+$")


def _listeners(net: netns.HubNetwork, i: int) -> list[str]:
    """Local addresses of the TCP listening sockets in facility ``i``'s namespace (``ss -ltn``)."""
    out = net.run(i, ["ss", "-ltnH"]).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def _dumps(where: Path, name: str) -> list[dict]:
    return [torch.load(p) for p in sorted((where / name).glob("round-*.pt"))]


def _start_hub(net: netns.HubNetwork, certs: Path, state: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "xffl_like.hub", "serve", "--port", "29790", "--certs", str(certs), "--state",
           str(state)]  # fmt: skip
    with open(log, "w") as out:
        hub = net.popen("hub", cmd, cwd=REPO, env=ENV, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 60
    while "serving on" not in log.read_text():
        assert hub.poll() is None and time.time() < deadline, f"the hub did not start: {log.read_text()}"
        time.sleep(0.1)
    return hub


def _start_facility(net, i: int, certs: Path, tmp_path: Path, dump: Path) -> subprocess.Popen:
    name = NAMES[i]
    args = [
        "+experiment=llama_fed", "logger=none", "distributed.federated=null", "distributed.nproc_per_node=1",
        f"federation.elastic.hub={net.hub_address(i)}:29790", f"federation.elastic.facility={name}",
        f"federation.elastic.ca={certs / 'ca.crt'}", f"federation.elastic.cert={certs / 'facilities' / f'{name}.crt'}",
        f"federation.elastic.key={certs / 'facilities' / f'{name}.key'}", "federation.elastic.min_facilities=2",
        "federation.elastic.grace_s=60", "federation.elastic.timeout_s=20", f"train.steps={STEPS}",
        f"federation.every={EVERY}", "optim.warmup_steps=2", "data.num_eval_batches=1",
        "checkpoint.every_rounds=1000000", *TINY, f"hydra.run.dir={tmp_path / f'run-{name}'}",
    ]  # fmt: skip
    out = open(tmp_path / f"{name}.log", "w")
    return net.popen(
        i,
        [sys.executable, "-m", "xffl_like.run", *args],
        cwd=REPO,
        env={**ENV, "PYTHONPATH": os.pathsep.join([str(PLUGINS), str(REPO)]), "XFFL_TEST_DUMP_ROUNDS": str(dump)},
        stdout=out,
        stderr=subprocess.STDOUT,
    )


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, 9)
    if proc is not None:
        proc.wait(timeout=30)


@pytest.mark.multiprocess
@pytest.mark.cli
@pytest.mark.slow
@pytest.mark.skipif(WHY is not None, reason=str(WHY))
def test_facilities_that_reach_only_the_hub_complete_their_rounds(tmp_path):
    certs, dump = tmp_path / "certs", tmp_path / "dump"
    with netns.HubNetwork(2, 100) as net:
        made = [net.hub, *(f.namespace for f in net.facilities)]
        init = [sys.executable, "-m", "xffl_like.hub", "init", str(certs), "--facilities", ",".join(NAMES),
                "--host", ",".join(net.hub_addresses)]  # fmt: skip
        subprocess.run(init, cwd=REPO, env=ENV, check=True, capture_output=True, timeout=60)
        hub = _start_hub(net, certs, tmp_path / "hub-state", tmp_path / "hub.log")
        procs: list[subprocess.Popen] = []
        try:
            procs = [_start_facility(net, i, certs, tmp_path, dump) for i in range(2)]
            _check_isolation(net)  # while the facilities start
            seen, sampled = 0, 0.0  # ss samples taken while both ran, after both had joined
            loopback: set[str] = set()  # what they listen on: their own rendezvous store, on loopback
            deadline = time.time() + 150
            while any(p.poll() is None for p in procs):
                assert time.time() < deadline, "timed out"
                assert all(p.poll() in (None, 0) for p in procs), (tmp_path / "a.log").read_text()[-3000:]
                if seen < 4 and time.time() - sampled > 1.0:  # a few samples, not a load on the facilities
                    sampled = time.time()
                    joined = all(any((dump / n).glob("round-*.pt")) for n in NAMES)
                    for i in range(2):
                        found = _listeners(net, i)
                        assert all(_LOOPBACK.match(a) for a in found), f"facility {NAMES[i]} listens on {found}"
                        loopback.update(found)
                        pids = net.run(i, ["ip", "netns", "pids", net.facilities[i].namespace]).stdout.split()
                        if joined and procs[i].poll() is None and str(procs[i].pid) in pids:
                            seen += 1
                time.sleep(0.2)
            assert [p.returncode for p in procs] == [0, 0], [(tmp_path / f"{n}.log").read_text()[-3000:] for n in NAMES]
            assert seen >= 2, "no listening-socket check ran while both facilities were in their rounds"
            assert loopback, "ss saw no listening socket at all in the facilities' namespaces"
        finally:
            for p in procs:
                _stop(p)
            _stop(hub)
    assert not any(name in _namespaces() for name in made), _namespaces()

    rounds = {n: _dumps(dump, n) for n in NAMES}
    joins = {n: r[0] for n, r in rounds.items()}
    assert sorted(j["status"] for j in joins.values()) == ["created", "joined"], joins
    theta0 = next(j["before"] for j in joins.values() if j["status"] == "created")
    assert all(torch.equal(j["after"], theta0) for j in joins.values()), "a facility did not start from θ_0"
    versions = list(range(1, STEPS // EVERY + 1))
    by = {n: {r["round"]: r for r in rs[1:]} for n, rs in rounds.items()}
    for v in versions:
        a, b = by["a"][v], by["b"][v]
        assert a["status"] == b["status"] == "accepted", (v, a["status"], b["status"])
        assert torch.equal(a["after"], b["after"]), f"version {v}: the facilities hold different θ_global"
        assert (a["before"] - b["before"]).abs().max() > 1e-4, f"version {v}: the facilities trained alike"
        mean = (a["before"].double() + b["before"].double()) / 2
        err = (a["after"].double() - mean).abs().max().item()
        assert err <= ATOL, f"version {v}: θ_global is {err:.3g} from the mean of the facilities' parameters"
    assert sorted(by["a"]) == sorted(by["b"]) == versions
    # the hub printed, per committed round, its time from the last upload to the result's first byte
    from xffl_like.bench.hub_rounds import hub_latencies

    latencies = hub_latencies((tmp_path / "hub.log").read_text())
    assert sorted(latencies) == versions, (tmp_path / "hub.log").read_text()[-2000:]
    assert all(0 <= lat <= round_s for lat, round_s in latencies.values()), latencies


# ---------------------------------------------------------------------------------------------- figures (pure)
def _rec(version, step, seconds, status="accepted"):
    return {"round": None if version is None else version - 1, "step": step, "seconds": seconds, "status": status}


def test_hub_bench_figures():
    assert hub_wan.line_seconds(1_250_000, 10) == pytest.approx(1.0)
    records = {
        "f0": [_rec(None, 0, 1.0, "created"), _rec(1, 2, 9.0), _rec(2, 4, 5.0), _rec(3, 6, 0.1, "missed")],
        "f1": [_rec(1, 2, 6.0, "joined"), _rec(2, 4, 7.0), _rec(3, 6, 0.2, "healed"), _rec(4, 8, 6.5)],
    }
    records["f1"][0]["round"] = 0
    times = hub_wan.round_times(records)
    assert times == {1: 9.0, 2: 5.0, 4: 6.5}  # per version, the least accepted record
    numel = 312_500  # 4 x numel = 1.25 MB: 1 s each way at 10 Mbit/s
    fig = hub_wan.round_figure(times, numel, 10, 10)
    assert fig["line_seconds"] == pytest.approx(2.0) and fig["ratio"] == pytest.approx(6.5 / 2)
    assert fig["max_ratio"] == pytest.approx(4.5) and fig["rounds"] == 3
    assert hub_wan.round_figure(times, numel, 10, 20)["line_seconds"] == pytest.approx(1.5)  # a faster downlink
    assert hub_wan.round_figure({}, numel, 10, 10) is None
    join = hub_wan.join_figure(records["f1"], numel, 10)
    assert join["seconds"] == 6.0 and join["ratio"] == pytest.approx(6.0)
    assert hub_wan.join_figure(records["f0"], numel, 10) is None
    assert hub_wan.payload_bytes(records["f0"], numel) == (3 * 4 * numel, 2 * 4 * numel)
    assert hub_wan.payload_bytes(records["f1"], numel) == (2 * 4 * numel, 4 * 4 * numel)
    tls = hub_wan.tls_figure({1: 5.5, 2: 5.5, 3: 9.0}, {1: 5.0, 2: 5.0})
    assert tls["cost"] == pytest.approx(0.1) and tls["rounds"] == [3, 2]
    assert hub_wan.tls_figure({}, {1: 5.0}) is None
    # results every 10 s, a kill at 25: the next result at 38 (the 20 -> 38 interval spans the kill, left out)
    stall = hub_wan.stall_figure(25.0, [0.0, 10.0, 20.0, 38.0, 48.0], grace_s=10.0)
    assert stall["seconds"] == pytest.approx(13.0) and stall["one_round_seconds"] == pytest.approx(10.0)
    assert stall["bound_seconds"] == pytest.approx(20.0) and stall["ratio"] == pytest.approx(0.65)
    assert hub_wan.stall_figure(25.0, [0.0, 10.0, 20.0], 10.0) is None  # no result after the kill
    lost = hub_wan.rounds_lost(records, version_at_kill=2)
    assert lost == {"f0": [6], "f1": [6]}  # f0 missed step 6 (then ends), f1 healed there then was accepted
    assert hub_wan.rounds_lost(records, version_at_kill=0) == {}
    boundaries = {"f0": {6: 31.0}, "f1": {6: 29.0}}
    fig = hub_wan.lost_figure(lost, boundaries, (20.0, 30.0), forgotten=0)
    assert fig["rounds"] == 1 and fig["after_hub_back"] == {"f0": 1, "f1": 0} and fig["outage_seconds"] == 10.0
    assert hub_wan.lost_figure(lost, boundaries, (20.0, 30.0), forgotten=1)["rounds"] == 2
    assert hub_wan.check_hub({"hub": {"scenarios": ["nope"]}}) is not None


def test_hub_bench_rounds_by_hand():
    """Issue 37: ``bench.mode=hub`` per round, each facility's bytes up and down, the hub's egress, the round's
    time over its slowest facility's bytes at line rate, the hub's latency from its log line; by hand."""
    from xffl_like.bench import hub_rounds
    from xffl_like.hub.server.latency import LINE

    # two facilities, counters (sent, received) at t = 0, 10, 20, 30 (linear between samples)
    samples = [
        (0.0, [(0, 0), (0, 0)]),
        (10.0, [(1_000_000, 2_000_000), (0, 0)]),
        (20.0, [(1_250_000, 4_500_000), (250_000, 2_500_000)]),
        (30.0, [(1_500_000, 7_000_000), (500_000, 5_000_000)]),
    ]
    assert hub_rounds.at(samples, 15.0) == [(1_125_000, 3_250_000), (125_000, 1_250_000)]
    held = {"f0": [(10.0, 1), (20.0, 2), (29.0, 3)], "f1": [(19.0, 2), (30.0, 3)]}
    windows = hub_rounds.round_windows(held, start=0.0)
    assert windows == {1: (0.0, 10.0), 2: (10.0, 20.0), 3: (20.0, 30.0)}  # the last facility to hold each
    log = "\n".join([LINE.format(0, 1, 0.5, 4.0), "hub: other", LINE.format(2, 3, 0.25, 8.0)])
    latencies = hub_rounds.hub_latencies(log)
    assert latencies == {1: (0.5, 4.0), 3: (0.25, 8.0)}
    records = {
        "f0": [_rec(None, 0, 1.0, "created"), _rec(1, 2, 9.0), _rec(2, 4, 5.0), _rec(3, 6, 4.0)],
        "f1": [_rec(2, 4, 6.0), _rec(3, 6, 8.0)],
    }
    accepted = hub_rounds.accepted_by_version(records)
    assert accepted == {1: ["f0"], 2: ["f0", "f1"], 3: ["f0", "f1"]}
    rows = hub_rounds.round_rows(samples, windows, hub_wan.round_times(records), latencies, 1.0, 2.0, accepted)
    r2 = rows[1]
    assert r2["up"] == [250_000, 250_000] and r2["down"] == [2_500_000, 2_500_000]
    assert r2["hub_egress"] == 5_000_000  # every byte the hub sent: the facilities' downloads
    # the slowest facility: 250 kB up at 1 Mbit/s (2 s) then 2.5 MB down at 2 Mbit/s (10 s); round 5 s (least)
    assert r2["line_seconds"] == pytest.approx(12.0) and r2["ratio"] == pytest.approx(5.0 / 12.0)
    assert r2["hub_latency_s"] is None and rows[2]["hub_latency_s"] == 0.25 and rows[2]["hub_round_s"] == 8.0
    assert rows[2]["seconds"] == 4.0 and rows[2]["ratio"] == pytest.approx(4.0 / 12.0)
    fig = hub_rounds.rounds_figure(rows, facilities=2)  # the first round (joins, one facility) left out
    assert fig["versions"] == [2, 3] and fig["ratio"] == pytest.approx((5.0 + 4.0) / 2 / 12.0)
    assert fig["hub_egress"] == 5_000_000 and fig["facility_bytes"] == 2_750_000 and fig["hub_latency_s"] == 0.25
    assert fig["hub_latency_share"] == pytest.approx(0.25 / 4.0)
    assert hub_rounds.rounds_figure(rows, facilities=3) is None  # no round accepted three
    b = hub_rounds.bytes_figure(fig, numel=1_000_000)
    assert b["fp32_bytes"] == 8_000_000 and b["ratio"] == pytest.approx(2_750_000 / 8_000_000)
    table = hub_rounds.format_rounds(rows, ["f0", "f1"])
    assert len(table) == 2 + 3 and "| 3 | 2 | 4.00 | 12.00 | 0.33 | 0.250 (8.00) | 5.00 | f0 0.25/2.50" in table[4]
    assert hub_rounds.rounds_goal(2) == 1.2 and hub_rounds.rounds_goal(8) == 1.5
    h = {"scenarios": ["line"], "bytes_overrides": [], "fault_overrides": []}
    bad_values = [
        ({"facilities": 1}, "bench.hub.facilities=1: must be an integer from 2 to 8"),
        ({"facilities": 9}, "bench.hub.facilities=9"),
        ({"facilities": True}, "facilities=True"),
        ({"compression": "zstd"}, "bench.hub.compression='zstd': choose from none, bf16, uint8, topk"),
    ]
    for bad, words in bad_values:
        line = hub_wan.check_hub({"hub": {**h, **bad}})
        assert line is not None and words in line and "\n" not in line, line
