"""An emulated wide-area network on one machine: one Linux network namespace per facility.

Facility ``f`` lives in namespace ``<prefix>-f<f>`` with one veth interface at
``10.77.0.<f+1>/24``; the other end of every veth is a port of a bridge in the switch
namespace ``<prefix>-sw``. A token bucket (``tc qdisc ... tbf``, the only shaper this kind
of kernel offers: netem is missing) limits both ends to ``link_mbit``, so each facility's
upload and download run at the line rate. Traffic inside a facility (to its own address or
to 127.0.0.1) stays on the namespace's loopback and is not shaped. The link adds no latency
beyond the kernel's own.

Each facility namespace is set up as a host on a wide-area link would be (:data:`WAN_SYSCTLS`):
``net.ipv4.tcp_slow_start_after_idle=0``, so that a connection idle between two rounds (tens of
seconds of local steps) keeps its congestion window instead of restarting from the initial
window of 10 segments (RFC 2861's default, meant for senders whose idle time makes the old
window stale; a federated job's connections carry the same bulk transfer every round). The
congestion control is the host's (recorded in :attr:`Network.tcp`).

``prefix`` is ``xfw<pid>``: a later :class:`Network` removes the namespaces of a process that
died without cleaning up (``sweep_stale``). :meth:`Network.close` kills what still runs in its
namespaces (by process id, from ``ip netns pids``) and deletes them, which deletes their veth
pairs; it runs on exit, on failure and on SIGINT/SIGTERM (:func:`cleanup_on_signals`).

:class:`HubNetwork` is the other topology, sites that reach only a hub: a namespace for the hub and one
per facility, a veth pair from each facility to the hub on its own subnet, no route between facilities
(see its docstring).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NetnsError",
    "Facility",
    "Network",
    "CounterSampler",
    "facility_cpus",
    "unavailable",
    "prepare_run_dir",
    "sweep_stale",
    "cleanup_on_signals",
    "launch_torchrun",
    "wait_launchers",
    "tx_at",
    "busy_window",
    "SUBNET",
    "WAN_SYSCTLS",
    "HubNetwork",
    "HUB_SUBNET",
]

SUBNET = "10.77.0"
#: Per-namespace settings of every facility (see the module's docstring): key -> value.
WAN_SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0"}
_TCP_KEYS = ("net.ipv4.tcp_congestion_control", "net.ipv4.tcp_slow_start_after_idle")
_KILL_GRACE_S = 10.0
_PREFIX_RE = re.compile(r"^xf[wh](\d+)-")  # xfw: Network, xfh: HubNetwork
_LINK_RE = re.compile(r"^[xy](\d+)[fsh]\d+$")  # x<pid>f/s<i>: Network, y<pid>f/h<i>: HubNetwork


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be set up; ``str(exc)`` is one line."""


@dataclass(frozen=True)
class Facility:
    """One facility's namespace, its veth interface (inside it) and that interface's address."""

    namespace: str
    interface: str
    address: str

    def exec_prefix(self) -> list[str]:
        """Command prefix that runs a program inside this facility's namespace."""
        return ["ip", "netns", "exec", self.namespace]


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or ``None`` when they can be tried."""
    if os.geteuid() != 0:
        return "needs root (ip netns, tc): run it as root, or in a container with CAP_NET_ADMIN"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2): install iproute2"
    return None


def prepare_run_dir(plain: dict, run_dir: Path) -> bool:
    """Namespaces can be made here (else the reason printed, False): the run directory with the benchmark's
    config in it."""
    why = unavailable()
    if why:
        print(f"bench.wan skipped: {why}", flush=True)
        return False
    from omegaconf import OmegaConf

    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(plain), run_dir / "config.yaml")
    return True


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        why = (proc.stderr or proc.stdout).strip().splitlines()
        raise NetnsError(f"`{' '.join(cmd)}` failed: {why[0] if why else f'exit {proc.returncode}'}")
    return proc


def _namespaces() -> list[str]:
    proc = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_inside(namespace: str, exclude: set[int] = frozenset()) -> None:
    """SIGKILL every process still running in ``namespace`` (by id: all were started here)."""
    proc = _run("ip", "netns", "pids", namespace, check=False)
    for pid in (int(p) for p in proc.stdout.split() if p.isdigit() and int(p) not in exclude):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _delete(namespace: str) -> None:
    _kill_inside(namespace)
    _run("ip", "netns", "delete", namespace, check=False)


def sweep_stale() -> list[str]:
    """Delete the namespaces (and veth ends not yet moved into one) of earlier runs whose
    process is dead; return their names."""
    removed = []
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for name in re.findall(r"^\d+: ([^:@]+)", links, flags=re.M):
        match = _LINK_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _run("ip", "link", "delete", name, check=False)
            removed.append(name)
    for name in _namespaces():
        match = _PREFIX_RE.match(name)
        if match and not _alive(int(match.group(1))):
            _delete(name)
            removed.append(name)
    return removed


def _tbf(namespace: str, interface: str, mbit: float) -> None:
    # The bucket must hold at least one timer tick of traffic at the rate, or the shaper
    # cannot reach it: 10 ms worth, at least 32 kbit (tc's own advice for low rates).
    burst_kbit = max(32, int(mbit * 1000 * 0.01))
    _run(
        "ip",
        "netns",
        "exec",
        namespace,
        "tc",
        "qdisc",
        "add",
        "dev",
        interface,
        "root",
        "tbf",
        "rate",
        f"{mbit}mbit",
        "burst",
        f"{burst_kbit}kbit",
        "latency",
        "400ms",
    )


def _sysctl(namespace: str, key: str, value: str | None = None) -> str:
    """Read (or set) ``key`` inside ``namespace`` through /proc/sys, which shows the reader's
    namespace (no ``sysctl`` binary needed); returns the value."""
    path = "/proc/sys/" + key.replace(".", "/")
    if value is not None:
        _run("ip", "netns", "exec", namespace, "sh", "-c", f"echo {value} > {path}")
    return _run("ip", "netns", "exec", namespace, "cat", path).stdout.strip()


class _Namespaces:
    """What both topologies share: the namespaces made (deleted by :meth:`close`, also when building
    fails), one holder process per facility whose ``/proc`` gives its interface's counters, and the
    context manager. A subclass sets ``facilities`` and builds in ``_build``."""

    facilities: list[Facility]

    def _start(self) -> None:
        self._made: list[str] = []
        #: TCP settings of the facility namespaces (congestion control, slow start after idle).
        self.tcp: dict[str, str] = {}
        self._holders: list[subprocess.Popen] = []
        self._closed = False
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        raise NotImplementedError

    def counters(self) -> list[tuple[int, int]]:
        """(tx_bytes, rx_bytes) of every facility's interface: bytes it sent over its link and received
        (Ethernet frames: headers included)."""
        out = []
        for fac, holder in zip(self.facilities, self._holders):
            for line in open(f"/proc/{holder.pid}/net/dev").read().splitlines():
                name, _, values = line.partition(":")
                if name.strip() == fac.interface:
                    fields = values.split()
                    out.append((int(fields[8]), int(fields[0])))
                    break
            else:
                raise NetnsError(f"interface {fac.interface} is gone from namespace {fac.namespace}")
        return out

    def close(self) -> None:
        """Kill the holders, delete the namespaces (and so their links). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for holder in self._holders:
            holder.kill()
            holder.wait()
        for name in reversed(self._made):
            _delete(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Network(_Namespaces):
    """``num_facilities`` namespaces joined by a bridge over links of ``link_mbit`` each way.

    Use as a context manager (or call :meth:`close`): every namespace and link it made is
    gone afterwards. :meth:`counters` reads each facility interface's byte counters.
    """

    def __init__(self, num_facilities: int, link_mbit: float, prefix: str | None = None):
        if num_facilities < 2:
            raise ValueError(f"a network needs at least 2 facilities, got {num_facilities}")
        if not link_mbit > 0:
            raise ValueError(f"link_mbit={link_mbit!r}: must be a positive number of Mbit/s")
        self.prefix = prefix or f"xfw{os.getpid()}"
        self.link_mbit = float(link_mbit)
        self.switch = f"{self.prefix}-sw"
        # Interface names hold at most 15 characters: x<pid>f<f> (facility end), x<pid>s<f> (switch port).
        self._tag = "x" + self.prefix.removeprefix("xfw")[:9]
        self.facilities = [
            Facility(f"{self.prefix}-f{f}", f"{self._tag}f{f}", f"{SUBNET}.{f + 1}") for f in range(num_facilities)
        ]
        self._start()

    def _build(self) -> None:
        sweep_stale()
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for f, fac in enumerate(self.facilities):
            self._add_namespace(fac.namespace)
            port = f"{self._tag}s{f}"
            # Made in this namespace, moved at once: a failure in between leaves a pair behind
            # only until the namespace (or this process's sweep) deletes it.
            _run("ip", "link", "add", fac.interface, "type", "veth", "peer", "name", port)
            _run("ip", "link", "set", port, "netns", self.switch)
            _run("ip", "link", "set", fac.interface, "netns", fac.namespace)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", fac.namespace, "addr", "add", f"{fac.address}/24", "dev", fac.interface)
            _run("ip", "-n", fac.namespace, "link", "set", fac.interface, "up")
            _run("ip", "-n", fac.namespace, "link", "set", "lo", "up")
            for key, value in WAN_SYSCTLS.items():
                _sysctl(fac.namespace, key, value)
            _tbf(fac.namespace, fac.interface, self.link_mbit)  # the facility's upload
            _tbf(self.switch, port, self.link_mbit)  # its download
            # A process that stays in the namespace: its /proc/<pid>/net/dev gives the
            # interface counters without starting a program per reading.
            self._holders.append(
                subprocess.Popen(
                    [*fac.exec_prefix(), "sleep", "2147483647"], stdin=subprocess.DEVNULL, start_new_session=True
                )
            )
        self.tcp = {key: _sysctl(self.facilities[0].namespace, key) for key in _TCP_KEYS}
        deadline = time.time() + 10
        while True:  # each holder reads its namespace's counters once it has entered it
            try:
                self.counters()
                break
            except NetnsError:
                if time.time() > deadline:
                    raise
                time.sleep(0.02)

    def add_service_address(self, host: int = 254) -> Facility:
        """An address on the bridge itself (``<SUBNET>.<host>``, in the switch namespace): a service
        node every facility reaches over its own shaped link."""
        address = f"{SUBNET}.{host}"
        _run("ip", "-n", self.switch, "addr", "add", f"{address}/24", "dev", "br0")
        _run("ip", "-n", self.switch, "link", "set", "lo", "up")
        return Facility(self.switch, "br0", address)

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)

    def kill_processes(self) -> None:
        """SIGKILL whatever still runs in the facilities' namespaces (a stopped or timed-out
        run's workers), leaving the network up for the next run."""
        holders = {h.pid for h in self._holders}
        for fac in self.facilities:
            _kill_inside(fac.namespace, exclude=holders)


class CounterSampler:
    """Samples :meth:`Network.counters` every ``interval_s`` in a thread: the bytes that crossed
    between two instants are then read off the series (:meth:`tx_between`)."""

    def __init__(self, network: Network, interval_s: float = 0.05):
        self.network, self.interval_s = network, interval_s
        self.samples: list[tuple[float, list[int]]] = []
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            while True:
                self.samples.append((time.time(), [tx for tx, _ in self.network.counters()]))
                if self._stop.wait(self.interval_s):
                    self.samples.append((time.time(), [tx for tx, _ in self.network.counters()]))
                    return
        except (OSError, NetnsError) as exc:  # the network went away under us: readings stop here
            self.error = f"counters unreadable: {exc}"

    def __enter__(self) -> CounterSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def tx_at(self, t: float) -> list[float]:
        """Every facility's transmitted bytes at time ``t`` (linear between samples)."""
        return tx_at(self.samples, t)

    def tx_between(self, t0: float, t1: float) -> list[float]:
        """Bytes each facility sent between ``t0`` and ``t1``."""
        if self.error is not None or (
            self.samples and self.samples[-1][0] < t1 - 5 * self.interval_s and not self._thread.is_alive()
        ):
            raise NetnsError(self.error or "the counters were not sampled up to the end of the run")
        a, b = self.tx_at(t0), self.tx_at(t1)
        return [y - x for x, y in zip(a, b)]


def tx_at(samples: list[tuple[float, list[int]]], t: float) -> list[float]:
    """Counters of ``samples`` ((time, per-facility bytes), time-ordered) at ``t``, linearly
    interpolated; clamped to the first and last sample."""
    if not samples:
        raise ValueError("no counter samples")
    if t <= samples[0][0]:
        return [float(v) for v in samples[0][1]]
    for (ta, va), (tb, vb) in zip(samples, samples[1:]):
        if t <= tb:
            w = 0.0 if tb == ta else (t - ta) / (tb - ta)
            return [x + w * (y - x) for x, y in zip(va, vb)]
    return [float(v) for v in samples[-1][1]]


def busy_window(
    samples: list[tuple[float, list[int]]], t0: float, t1: float, rate: float, threshold: float = 0.05
) -> tuple[float, float] | None:
    """``(start, end)`` of the sampling intervals inside ``[t0, t1]`` during which some facility
    sent more than ``threshold`` x ``rate`` (bytes/s): from the start of the first such interval
    to the end of the last, so the window contains the whole transfer (up to one interval more
    at each edge); ``None`` when none did."""
    busy = [
        (ta, tb)
        for (ta, va), (tb, vb) in zip(samples, samples[1:])
        if tb > t0 and ta < t1 and tb > ta and max(y - x for x, y in zip(va, vb)) > threshold * rate * (tb - ta)
    ]
    return (max(busy[0][0], t0), min(busy[-1][1], t1)) if busy else None


def facility_cpus(facilities: int, cpus: list[int] | None = None) -> list[list[int]] | None:
    """Each facility's share of this process's CPUs (contiguous, equal, the remainder unused); None
    when there are fewer CPUs than facilities (nothing to pin)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else sorted(cpus)
    share = len(cpus) // facilities
    if share == 0:
        return None
    return [cpus[f * share : (f + 1) * share] for f in range(facilities)]


def launch_torchrun(
    network: Network,
    nproc_per_node: int,
    entry: list[str],
    env: dict[str, str],
    log_dir: Path,
    port: int,
    pin: bool = False,
) -> list[subprocess.Popen]:
    """One ``torchrun`` per facility, inside its namespace, as a multi-site job starts: all join
    one static rendezvous at facility 0's link address (node rank = facility, so global ranks
    are contiguous per facility). gloo binds each facility's link interface
    (``GLOO_SOCKET_IFNAME``): peers in other facilities reach it across the link, peers in the
    same facility over its loopback. ``entry``: what torchrun runs (``["-m", module, args...]``);
    each launcher's output goes to ``log_dir/facility<f>.log``. ``pin``: facility f's launcher and workers run
    on its share of the CPUs only (:func:`facility_cpus`), so that facilities on one small machine do not take CPU
    from each other (a slowed facility stays exactly as slow as it was made)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    endpoint = f"{network.facilities[0].address}:{port}"
    shares = facility_cpus(len(network.facilities)) if pin else None
    procs = []
    for f, fac in enumerate(network.facilities):
        cmd = [
            *fac.exec_prefix(),
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={len(network.facilities)}",
            f"--nproc-per-node={nproc_per_node}",
            f"--node-rank={f}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={endpoint}",
            "--max-restarts=0",
            *entry,
        ]
        with open(log_dir / f"facility{f}.log", "w") as log:
            cpus = shares[f] if shares else None
            procs.append(
                subprocess.Popen(
                    cmd,
                    env={**os.environ, **env, "GLOO_SOCKET_IFNAME": fac.interface},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=(lambda cpus=cpus: os.sched_setaffinity(0, cpus)) if cpus else None,
                )
            )
    return procs


def wait_launchers(procs: list[subprocess.Popen], network: Network, timeout_s: float) -> str | None:
    """Wait for every launcher of :func:`launch_torchrun`: ``None`` when all exited 0, else why
    not, after stopping them and killing whatever they left in the namespaces."""
    deadline = time.time() + timeout_s
    why = f"timed out after {timeout_s:.0f} s"
    while time.time() < deadline:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return None
        failed = [f for f, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            why = f"facility {failed[0]}'s launcher exited with {codes[failed[0]]}"
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.terminate()  # torchrun stops its workers on SIGTERM
    for p in procs:
        try:
            p.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
    network.kill_processes()
    for p in procs:
        p.wait()
    return why


@contextmanager
def cleanup_on_signals() -> Iterator[None]:
    """Turn SIGTERM (and SIGHUP) into ``SystemExit`` while inside, so that ``finally`` blocks
    and context managers (a :class:`Network`) run; Ctrl-C already raises KeyboardInterrupt."""

    def handler(signum, _frame):
        raise SystemExit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


#: :class:`HubNetwork`: facility ``i``'s link is ``<HUB_SUBNET>.<i>.0/24``, the hub's end ``.1``, the facility's ``.2``.
HUB_SUBNET = "10.78"


class HubNetwork(_Namespaces):
    """Sites that reach only a hub: one namespace for the hub, one per facility, and one veth pair from
    each facility's namespace to the hub's, each pair its own subnet (``<HUB_SUBNET>.<i>.0/24``: the hub's
    end ``.1``, the facility's ``.2``).

    Isolation by topology (no firewall rules): a facility's namespace holds its loopback and its end of
    its own pair, with the connected route of that /24 and no default route, so the only other host it
    can reach is the hub's address on its link; the hub's namespace starts with ``net.ipv4.ip_forward=0``
    (checked here: :class:`NetnsError` otherwise), so it does not route between its pairs.

    Shaping (``tc tbf``): the facility's end of pair ``i`` at ``link_mbit`` (its uplink, the facility's
    egress) and the hub's end at ``link_mbit`` (its downlink), each facility's line the only bottleneck:
    every facility has its own pair, so the hub adds none of its own (a VM in a data centre, its network
    faster than any one facility's line). With ``hub_multiple`` the hub's end is shaped at
    ``hub_multiple x link_mbit`` instead (a facility's downlink that many times its uplink):
    :attr:`down_mbit`. :data:`WAN_SYSCTLS` are set in every namespace (the hub sends the downloads).

    Names: namespaces ``xfh<pid>-hub`` and ``xfh<pid>-f<i>``, interfaces ``y<pid>f<i>`` (facility's end) and
    ``y<pid>h<i>`` (hub's end); :func:`sweep_stale` removes those of a process that died. Use as a context
    manager (or call :meth:`close`, idempotent): whatever runs in the namespaces is killed by process id and
    the namespaces (and so the pairs) are deleted, also on an exception or Ctrl-C (SIGTERM with
    :func:`cleanup_on_signals`). Every ``ip``/``tc`` command is bounded (30 s).
    """

    def __init__(self, facilities: int, link_mbit: float, hub_multiple: float | None = None, prefix: str | None = None):
        if facilities < 1:
            raise ValueError(f"a hub network needs at least 1 facility, got {facilities}")
        if facilities > 250:
            raise ValueError(f"facilities={facilities}: at most 250 (one /24 each under {HUB_SUBNET})")
        if not link_mbit > 0:
            raise ValueError(f"link_mbit={link_mbit!r}: must be a positive number of Mbit/s")
        if hub_multiple is not None and not hub_multiple > 0:
            raise ValueError(f"hub_multiple={hub_multiple!r}: must be a positive number (or None)")
        self.prefix = prefix or f"xfh{os.getpid()}"
        self.link_mbit = float(link_mbit)
        #: The rate of the hub's end of every pair: each facility's download.
        self.down_mbit = self.link_mbit * (hub_multiple if hub_multiple is not None else 1.0)
        self.hub = f"{self.prefix}-hub"
        tag = "y" + self.prefix.removeprefix("xfh")[:9]
        self.facilities = [
            Facility(f"{self.prefix}-f{i}", f"{tag}f{i}", f"{HUB_SUBNET}.{i}.2") for i in range(facilities)
        ]
        #: The hub's end of each pair (in the hub's namespace) and its address there.
        self.hub_interfaces = [f"{tag}h{i}" for i in range(facilities)]
        self.hub_addresses = [f"{HUB_SUBNET}.{i}.1" for i in range(facilities)]
        self._start()

    def _build(self) -> None:
        sweep_stale()
        _run("ip", "netns", "add", self.hub)
        self._made.append(self.hub)
        _run("ip", "-n", self.hub, "link", "set", "lo", "up")
        forwarding = _sysctl(self.hub, "net.ipv4.ip_forward")
        if forwarding != "0":
            raise NetnsError(f"net.ipv4.ip_forward={forwarding} in the new namespace {self.hub}: it would route "
                             f"between facilities")  # fmt: skip
        for key, value in WAN_SYSCTLS.items():
            _sysctl(self.hub, key, value)
        for i, fac in enumerate(self.facilities):
            _run("ip", "netns", "add", fac.namespace)
            self._made.append(fac.namespace)
            hub_end = self.hub_interfaces[i]
            # Made in this namespace, moved at once (a failure in between: swept by name later).
            _run("ip", "link", "add", fac.interface, "type", "veth", "peer", "name", hub_end)
            _run("ip", "link", "set", hub_end, "netns", self.hub)
            _run("ip", "link", "set", fac.interface, "netns", fac.namespace)
            _run("ip", "-n", self.hub, "addr", "add", f"{self.hub_addresses[i]}/24", "dev", hub_end)
            _run("ip", "-n", self.hub, "link", "set", hub_end, "up")
            _run("ip", "-n", fac.namespace, "addr", "add", f"{fac.address}/24", "dev", fac.interface)
            _run("ip", "-n", fac.namespace, "link", "set", fac.interface, "up")
            _run("ip", "-n", fac.namespace, "link", "set", "lo", "up")
            for key, value in WAN_SYSCTLS.items():
                _sysctl(fac.namespace, key, value)
            routes = _run("ip", "-n", fac.namespace, "route", "show").stdout
            if "default" in routes:
                raise NetnsError(f"namespace {fac.namespace} has a default route: {routes.strip()}")
            _tbf(fac.namespace, fac.interface, self.link_mbit)  # the facility's upload
            _tbf(self.hub, hub_end, self.down_mbit)  # its download
            self._holders.append(
                subprocess.Popen(
                    [*fac.exec_prefix(), "sleep", "2147483647"], stdin=subprocess.DEVNULL, start_new_session=True
                )
            )
        self.tcp = {key: _sysctl(self.hub, key) for key in _TCP_KEYS}
        deadline = time.time() + 10
        while True:  # each holder reads its namespace's counters once it has entered it
            try:
                self.counters()
                break
            except (NetnsError, OSError):
                if time.time() > deadline:
                    raise
                time.sleep(0.02)

    def namespace(self, where: int | str) -> str:
        """The namespace of facility ``where`` (an index), or the hub's (``"hub"``)."""
        if where == "hub":
            return self.hub
        if isinstance(where, int) and 0 <= where < len(self.facilities):
            return self.facilities[where].namespace
        raise ValueError(f"where={where!r}: a facility index (0..{len(self.facilities) - 1}) or 'hub'")

    def exec_prefix(self, where: int | str) -> list[str]:
        """Command prefix that runs a program in facility ``where``'s namespace (or the hub's)."""
        return ["ip", "netns", "exec", self.namespace(where)]

    def popen(self, where: int | str, cmd: list[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in facility ``where``'s namespace (or the hub's), in a session of its own (so its
        whole process group can be killed); stdin from /dev/null unless given."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        return subprocess.Popen([*self.exec_prefix(where), *cmd], **kwargs)

    def run(self, where: int | str, cmd: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run ``cmd`` to its end in facility ``where``'s namespace (or the hub's), bounded by ``timeout``."""
        return subprocess.run(
            [*self.exec_prefix(where), *cmd], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )

    def hub_address(self, facility: int) -> str:
        """The hub's address as facility ``facility`` sees it: the hub's end of that facility's pair."""
        return self.hub_addresses[facility]

    def kill_processes(self) -> None:
        """SIGKILL whatever still runs in the namespaces (the hub's included), leaving the network up."""
        holders = {h.pid for h in self._holders}
        for name in self._made:
            _kill_inside(name, exclude=holders)

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them (and so their pairs). Idempotent."""
        if self._closed:
            return
        super().close()
        for i, fac in enumerate(self.facilities):  # a pair made but not yet moved: still in this namespace
            for name in (fac.interface, self.hub_interfaces[i]):
                if os.path.exists(f"/sys/class/net/{name}"):
                    _run("ip", "link", "delete", name, check=False)
