"""Facilities meeting at a real hub (``python -m xffl_like.hub serve``) over mutual TLS on localhost.

Each facility is its own ``python -m xffl_like.run`` job (its own process group, killed with SIGKILL
to the group); the certificates are made once per module with ``python -m xffl_like.hub init``.
Every expected value is computed here, from what each facility's leader dumps per round
($XFFL_TEST_DUMP_ROUNDS: its parameters ``before`` the upload, θ_global ``after``) and from the
hub's state files (copied as they appear: the hub keeps only its last two), never from the hub's
code: the weighted mean and the Nesterov step are written out below.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import REPO, TINY
from helpers.hub import ENV as HUB_ENV
from helpers.hub import STATE_FILE, Facility, Hub, free_port, init_certs
from helpers.hub import dumped as _dumped
from helpers.hub import export_of as _export
from helpers.hub import newest_state as _newest_state
from helpers.hub import output as _text
from helpers.hub import read_state as _read_state
from helpers.hub import state_version as _version
from helpers.hub import state_versions as _versions
from helpers.hub import value_bits as _values
from helpers.hub import wait_alive as _wait_for

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli, pytest.mark.slow]

EVERY = 2
OUTER_LR, MOMENTUM = 0.7, 0.9  # federation.outer: nesterov (DiLoCo's)
NESTEROV = [
    "federation.outer.name=nesterov",
    f"federation.outer.lr={OUTER_LR}",
    f"federation.outer.momentum={MOMENTUM}",
]
#: Every name the module's certificates are made for (``gone`` is revoked by the identity test).
NAMES = ("a", "b", "c", "s", "t", "gone")
ENV = {**os.environ, **HUB_ENV}
# The hub's fp32 mean and Nesterov step against the float64 ones here, values of magnitude <= ~1.1.
RTOL, ATOL = 1e-6, 1e-6  # seen: 2.5e-7


def _hub_cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.hub", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, f"hub {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    """A CA, the hub's certificate for localhost and 127.0.0.1, and one identity per name of :data:`NAMES`."""
    return init_certs(tmp_path_factory.mktemp("pki") / "certs", list(NAMES))


def _committed(log: str) -> list[tuple[int, list[str]]]:
    """(version, accepted facilities) of every commit line in a hub's log."""
    found = re.findall(r"committed version (\d+): ([^;(]*)", log)
    return [(int(v), sorted(n.strip() for n in names.split(","))) for v, names in found]


class StateCopies:
    """Every state file the hub writes, copied as soon as it appears (the hub keeps only its last two)."""

    def __init__(self, state: Path, into: Path):
        self.state, self.into = state, into
        into.mkdir(parents=True, exist_ok=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._scan()

    def _scan(self) -> None:
        if not self.state.exists():
            return
        for p in self.state.glob("state-*.safetensors"):  # written by rename: a file seen is whole
            target = self.into / p.name
            if not target.exists():
                with contextlib.suppress(FileNotFoundError):
                    shutil.copyfile(p, self.into / f".{p.name}")
                    os.replace(self.into / f".{p.name}", target)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._scan()

    def load(self) -> dict[int, tuple[dict, dict[str, torch.Tensor]]]:
        """version -> (metadata, tensors) of every copy."""
        out = {}
        for p in self.into.glob("state-*.safetensors"):
            meta, tensors = _read_state(p)
            assert meta["version"] == int(STATE_FILE.match(p.name).group(1)), p
            out[meta["version"]] = (meta, tensors)
        return out


def _records(f: Facility) -> list[dict]:
    """The rounds of its summary.json (``federation.elastic.rounds``)."""
    return f.summary()["federation"]["elastic"]["rounds"]


def _dumps(f: Facility, since: float = 0.0, joins: bool = False) -> list[dict]:
    """Its leader's dumped rounds written after ``since`` (time.time()), in the order written; its join (status
    ``created``: its parameters became θ_0, or ``joined``: it received θ_global) only with ``joins``."""
    paths = [(int(p.stem.rsplit("-", 1)[1]), p) for p in (f.dump / f.name).glob("round-*.pt")]
    out = [torch.load(p) for ns, p in sorted(paths) if ns >= since * 1e9]
    return [r for r in out if joins or r["status"] not in ("joined", "created")]


def _theta_0(facilities) -> torch.Tensor:
    """θ_0: the parameters of the one facility that created the federation; every other one joined with them."""
    joins = {f.name: _dumps(f, joins=True)[0] for f in facilities}
    created = [n for n, r in joins.items() if r["status"] == "created"]
    assert len(created) == 1, {n: r["status"] for n, r in joins.items()}
    theta = joins[created[0]]["before"]
    for n, r in joins.items():
        assert r["round"] == 0 and torch.equal(r["after"], theta), f"{n} did not start from θ_0"
    return theta


def _start(name, hub, tmp_path, steps, nproc=1, **kw) -> Facility:
    base = [f"train.steps={steps}", f"federation.every={EVERY}", "optim.warmup_steps=2"]
    return Facility(name, hub, tmp_path, nproc=nproc, base=base, **kw)


def _finish(facilities, timeout=300) -> None:
    """Wait for every facility; each must exit 0."""
    for f in facilities:
        rc, out = f.wait(timeout)
        assert rc == 0, f"{f.name} exited {rc}:\n{out[-4000:]}"


def _mean(befores: list[torch.Tensor]) -> torch.Tensor:
    """The uniform mean, in float64 (every facility takes the same steps per round: uniform weights)."""
    return sum(b.double() for b in befores) / len(befores)


def _nesterov(theta: torch.Tensor, buf: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """By hand (torch.optim.SGD(nesterov=True)'s rule on the pseudo-gradient), float64: delta = θ - mean;
    buf = momentum·buf + delta; θ' = θ - lr·(delta + momentum·buf)."""
    delta = theta.double() - mean
    buf = MOMENTUM * buf.double() + delta
    return theta.double() - OUTER_LR * (delta + MOMENTUM * buf), buf


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    err = (actual.double() - expected).abs().max().item()
    torch.testing.assert_close(actual.double(), expected, rtol=RTOL, atol=ATOL, msg=f"{what}: max error {err:.3g}")


def _by_version(rounds: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in rounds:
        assert r["round"] not in out, f"version {r['round']} dumped twice"
        out[r["round"]] = r
    return out


# ---------------------------------------------------------------------------------------------------- rounds
# One federation of five facilities through one hub, each honest or poisoned its own way:
#   a: 1 process (FSDP), honest until its weights hold a NaN after the last step (on_nonfinite=skip);
#   b: 2 processes (FSDP), c: 2 processes (HSDP: 2 replicas of 1 shard): honest;
#   s: 1 process, uploads its parameters x 1e6 every round; t: 1 process, claims 1e12 tokens every round.
# Four finite uploads in the first round, three in the second: the median of a round's norms is an honest one.
STEPS = 4  # rounds at steps 2 and 4: versions 1 and 2
ROUND_NAMES = ("a", "b", "c", "s", "t")
HONEST = {1: ["a", "b", "c"], 2: ["b", "c"]}  # by design: whose parameters each version averages


@pytest.fixture(scope="module")
def federation(certs, tmp_path_factory):
    """The five facilities' run, finished: (hub, {name: Facility}, the hub's state files by version)."""
    tmp = tmp_path_factory.mktemp("rounds")
    hub = Hub(tmp, certs)
    copies = StateCopies(hub.state, tmp / "copies")
    common = [*NESTEROV, "federation.elastic.min_facilities=5"]
    nan = ["fault.nan_rank=0", f"fault.nan_step={STEPS}", "federation.on_nonfinite=skip"]
    spec = {
        "a": dict(extra=[*common, *nan]),
        "b": dict(nproc=2, extra=common),
        "c": dict(nproc=2, extra=[*common, "distributed.hsdp=1"]),
        "s": dict(extra=common, env={"XFFL_TEST_HUB_SCALE": "1e6"}),
        "t": dict(extra=common, env={"XFFL_TEST_HUB_TOKENS": "1e12"}),
    }
    facilities = {n: _start(n, hub, tmp, STEPS, **kw) for n, kw in spec.items()}
    try:
        _finish(facilities.values())
    finally:
        for f in facilities.values():
            f.kill()
        hub.stop()
        copies.stop()
    return hub, facilities, copies.load()


def test_rounds_are_the_nesterov_step_of_the_accepted_mean(federation):
    hub, facilities, saved = federation
    rounds = {n: _by_version(_dumps(f)) for n, f in facilities.items()}
    versions = [1, 2]
    for n in ROUND_NAMES:  # every facility took part in every version, and holds θ_global after it bit for bit
        assert sorted(rounds[n]) == versions, (n, sorted(rounds[n]))
        for v in versions:
            assert torch.equal(rounds[n][v]["after"], rounds["b"][v]["after"]), (n, v)
    theta = _theta_0(facilities.values())
    assert 0 not in saved or torch.equal(saved[0][1]["theta"], theta), "state-0 does not hold θ_0"
    buf = torch.zeros(theta.numel(), dtype=torch.float64)
    for v in versions:
        accepted = sorted(n for n in ROUND_NAMES if rounds[n][v]["status"] == "accepted")
        assert {"b", "c"} <= set(accepted) <= {"a", "b", "c"}, (v, accepted)
        for n in ROUND_NAMES:  # uniform weights over the accepted ones
            assert rounds[n][v]["weights"] == pytest.approx({m: 1 / len(accepted) for m in accepted}), (v, n)
        befores = [rounds[n][v]["before"] for n in accepted]
        assert (befores[0] - befores[1]).abs().max() > 1e-4, f"version {v}: the facilities trained alike"
        mean = _mean(befores)
        expected, buf = _nesterov(theta, buf, mean)
        after = rounds["b"][v]["after"]
        _close(after, expected, f"version {v}")
        assert (after.double() - mean).abs().max() > 1e-3, f"version {v} is the plain mean, not Nesterov's step"
        if v in saved:
            assert torch.equal(saved[v][1]["theta"], after), f"state-{v}'s theta is not θ_global after version {v}"
        theta = after
    # The hub's newest state file: θ_global bit for bit, the momentum written out here.
    assert _versions(hub)[-1] == versions[-1], _versions(hub)
    meta, tensors = _newest_state(hub)
    assert meta["version"] == versions[-1] and sorted(meta["members"]) == sorted(ROUND_NAMES), meta
    assert torch.equal(tensors["theta"], theta)
    _close(tensors["outer.momentum_buffer"], buf, "the saved momentum")
    assert [v for v, _ in _committed(hub.logs())] == versions, hub.logs()


def _check_rejected(facilities, name: str, versions: list[int], words: str) -> None:
    """Facility ``name``'s contribution is rejected from ``versions`` for ``words`` (in its dumps, its summary.json
    and its log); it still ends each of them holding θ_global bit for bit."""
    f = facilities[name]
    mine, other = _by_version(_dumps(f)), _by_version(_dumps(facilities["b"]))
    records = {r["step"]: r for r in _records(f)}
    for v in versions:
        assert mine[v]["status"] == "rejected", (name, v, mine[v]["status"])
        assert not mine[v]["applied"] and name not in other[v]["weights"], (name, v)
        assert torch.equal(mine[v]["after"], other[v]["after"]), f"{name} does not hold θ_global after version {v}"
        record = records[EVERY * v]
        assert record["status"] == "rejected" and words in (record.get("reason") or ""), (name, v, record)
    assert words in _text(f) and "rejected" in _text(f), _text(f)[-3000:]


def _check_honest_rounds(facilities, saved, last: int) -> None:
    """Versions 1 to ``last``: each is Nesterov's step on the mean of the honest facilities (:data:`HONEST`)."""
    rounds = {n: _by_version(_dumps(facilities[n])) for n in ("a", "b", "c")}
    theta = _theta_0(facilities.values())
    buf = torch.zeros(theta.numel(), dtype=torch.float64)
    for v in range(1, last + 1):
        names = HONEST[v]
        expected, buf = _nesterov(theta, buf, _mean([rounds[n][v]["before"] for n in names]))
        _close(rounds["b"][v]["after"], expected, f"version {v} from {names}")
        theta = rounds["b"][v]["after"]


def test_an_upload_scaled_1e6_is_rejected_for_its_norm(federation):
    hub, facilities, saved = federation
    _check_rejected(facilities, "s", [1, 2], "norm")
    for v, r in _by_version(_dumps(facilities["b"])).items():
        assert "norm" in r["rejected"].get("s", ""), (v, r["rejected"])
    assert len(re.findall(r"facility s's contribution rejected: update norm", hub.logs())) == 2, hub.logs()
    _check_honest_rounds(facilities, saved, 1)  # version 2 waits for a's NaN to be rejected


def test_a_claim_of_1e12_tokens_is_rejected(federation):
    # docs/running.md: a contribution is rejected, with the reason in the hub's log, the facility's own log
    # and its summary.json, when it claims more tokens than its geometry allows.
    hub, facilities, saved = federation
    _check_rejected(facilities, "t", [1, 2], "tokens")
    assert len(re.findall(r"facility t's contribution rejected: .*tokens", hub.logs())) == 2, hub.logs()
    _check_honest_rounds(facilities, saved, 1)


def test_non_finite_weights_with_skip_are_uploaded_and_rejected(federation):
    # docs/running.md: federation.on_nonfinite=skip uploads them to be rejected and heals.
    hub, facilities, saved = federation
    assert _by_version(_dumps(facilities["a"]))[1]["status"] == "accepted"  # honest before its NaN
    _check_rejected(facilities, "a", [2], "not finite")
    assert _by_version(_dumps(facilities["b"]))[2]["rejected"].get("a") == "not finite"
    assert "facility a's contribution rejected: not finite" in hub.logs(), hub.logs()
    _check_honest_rounds(facilities, saved, 2)


# ---------------------------------------------------------------------------------------------------- durability
def _check_one_history(hub: Hub, facilities, saved: dict, since: float = 0.0) -> int:
    """One θ_global per version, whatever died when: the hub committed versions 1, 2, ... once each (its commit
    lines, and the state file of a commit whose line a SIGKILL cut off); every dump of version v holds the same θ
    (the saved one where it was seen); each facility's versions never go back and its accepted ones strictly
    increase; all end with the hub's newest θ. Returns the final version."""
    committed = [v for v, _ in _committed(hub.logs())]
    assert committed == sorted(set(committed)), f"commits {committed}:\n{hub.logs()}"
    final = committed[-1]
    assert set(committed) | (set(saved) - {0}) == set(range(1, final + 1)), (committed, sorted(saved))
    meta, tensors = _newest_state(hub)
    assert meta["version"] == final, (meta["version"], final)
    thetas: dict[int, torch.Tensor] = {v: t["theta"] for v, (_, t) in saved.items()}
    for f in facilities:
        rounds = _dumps(f, since)
        versions = [r["round"] for r in rounds]
        accepted = [r["round"] for r in rounds if r["status"] == "accepted"]
        assert versions == sorted(versions) and accepted == sorted(set(accepted)), f"{f.name}: {versions} {accepted}"
        for r in rounds:
            held = thetas.setdefault(r["round"], r["after"])
            assert torch.equal(r["after"], held), f"{f.name}: another θ for version {r['round']}"
        assert versions[-1] == final, (f.name, versions)
        assert torch.equal(rounds[-1]["after"], tensors["theta"]), f"{f.name} does not end with the hub's θ"
    return final


def _check_commit_from_saved(saved_meta: dict, saved: dict[str, torch.Tensor], facilities, since: float) -> None:
    """The version after the saved one is Nesterov's step from the saved θ and momentum, on the mean of the
    contributions accepted into it (a hub that lost its momentum, or applied a round twice, fails)."""
    v = saved_meta["version"]
    nxt = {f.name: r for f in facilities for r in _dumps(f, since) if r["round"] == v + 1}
    accepted = sorted(n for n, r in nxt.items() if r["status"] == "accepted")
    assert accepted, f"no dumped contribution to version {v + 1}: {[(n, r['status']) for n, r in nxt.items()]}"
    theta, buf = saved["theta"], saved["outer.momentum_buffer"]
    assert buf.abs().max() > 1e-3, "the saved momentum is zero"
    mean = _mean([nxt[n]["before"] for n in accepted])
    expected, _ = _nesterov(theta, buf, mean)
    after = nxt[accepted[0]]["after"]
    _close(after, expected, f"version {v + 1} from the saved version {v} and {accepted}")
    forgot, _ = _nesterov(theta, torch.zeros_like(buf), mean)
    assert (after.double() - forgot).abs().max() > 100 * ATOL, "the momentum does not show in the step"


# Issue 37: three facilities through a TLS hub that is SIGKILLed mid-run and restarted on its --state. b's steps
# take twice as long; c starts with them but joins only once version 1 exists (late). At the kill a and b wait
# before their round at version 2 (step 6) until the test lets them go: a at once (it misses its rounds at 6 and
# 8, its last, and waits for the final version), b once it missed step 6 (it waits again at 8); c misses what it
# meets. After the restart no facility is at the federation's step (6).
KILLED_STEPS = 8  # rounds at 2, 4, 6, 8: the federation's last is version 4


def test_the_hub_killed_mid_run_every_facility_realigns_and_exports_the_final_theta(certs, tmp_path):
    hub = Hub(tmp_path, certs)
    copies = StateCopies(hub.state, tmp_path / "copies")
    common = [*NESTEROV, "federation.elastic.grace_s=60", "federation.elastic.final_wait_s=200", "export.hf=true",
              "federation.elastic.min_facilities=2"]  # fmt: skip
    go = {n: tmp_path / f"go-{n}" for n in "abc"}
    hold = {"a": f"2:{go['a']}", "b": f"2:{go['b']}", "c": f"0:{go['c']}"}  # c: before it joins
    pace = {"b": ["fault.slow_facility=0", "fault.slow_factor=2.0"]}
    facilities = [_start(n, hub, tmp_path, KILLED_STEPS, extra=[*common, *pace.get(n, [])],
                         env={"XFFL_TEST_ELASTIC_HOLD": hold[n]}) for n in "abc"]  # fmt: skip
    a, b, c = facilities
    try:
        _wait_for(lambda: _version(hub) >= 1, what="version 1", alive=facilities)
        go["c"].touch()  # c joins now
        _wait_for(lambda: all(_dumped(f, 2) for f in (a, b)) and _dumps(c, joins=True), what="version 2 at a and b, c "
                  "joined", alive=facilities)  # fmt: skip
        hub.kill()
        meta, tensors = _newest_state(hub)
        go["a"].touch(), go["b"].touch()
        _wait_for(lambda: "round at step 6 missed" in _text(b), 120, "b's miss at step 6", alive=facilities)
        go["b"].unlink()  # b waits again at step 8, still at version 2
        _wait_for(lambda: "round at step 8 missed" in _text(a), 120, "a's last round missed", alive=facilities)
        hub.start()  # on its saved state
        go["b"].touch()
        _finish(facilities)
    finally:
        for f in facilities:
            f.kill()
        hub.stop()
        copies.stop()
    assert meta["version"] == 2 and "at version 2" in hub.log.read_text(), meta["version"]
    assert _check_one_history(hub, facilities, copies.load()) == KILLED_STEPS // EVERY  # once each, all end on it
    _check_commit_from_saved(meta, tensors, facilities, 0.0)  # the round after the restart: the saved θ and momentum
    for f in facilities:  # no round merged contributions of different federation steps: version v's are at step 2v
        for r in _dumps(f):
            assert r["status"] != "accepted" or r["step"] == EVERY * r["round"], (f.name, r["round"], r["step"])
    join = _dumps(c, joins=True)[0]
    assert join["status"] == "joined" and join["round"] >= 1 and join["step"] == EVERY * join["round"], join
    steps = {f.name: [(r["step"], r["status"]) for r in _records(f)] for f in facilities}
    assert all(any(s == "missed" for _, s in steps[n]) for n in "ab"), steps
    # After the restart each is at another step than the federation's 6: those the federation is behind realign
    # back and train on (which ones depends on who is live first: a link reconnecting is not), and each ends at
    # its last step with the final version, by taking part in the last round or receiving its result.
    assert any(f"facility {f.name}: realigned from step {KILLED_STEPS} to" in _text(f) for f in facilities)
    assert all(row[-1][0] == KILLED_STEPS and row[-1][1] in ("accepted", "healed") for row in steps.values()), steps
    # The hub's final θ_global, read from its state file here, is every facility's export, bit for bit.
    final_meta, final = _newest_state(hub)
    assert final_meta["ended"] and final_meta["progress"] == KILLED_STEPS // EVERY, final_meta
    exports = {f.name: _export(f) for f in facilities}
    for n, e in exports.items():
        assert e.keys() == exports["a"].keys() and all(torch.equal(e[k], exports["a"][k]) for k in e), n
        assert torch.equal(_values(e.values()), _values([final["theta"]])), f"{n}'s export is not the hub's θ_global"


def test_everything_down_resumes_with_the_hubs_saved_momentum(certs, tmp_path):
    hub = Hub(tmp_path, certs)
    copies = StateCopies(hub.state, tmp_path / "copies")
    extra = [*NESTEROV, "federation.elastic.min_facilities=2"]  # a checkpoint every round (Facility's)
    first = [_start(n, hub, tmp_path, 8, extra=extra) for n in ("a", "b")]
    again = []
    try:
        _wait_for(lambda: _version(hub) >= 2, what="version 2 saved", alive=first)
        hub.kill()
        for f in first:
            f.kill()
        meta, tensors = _newest_state(hub)
        back = time.time()
        hub.start()
        again = [_start(f.name, hub, tmp_path, 8, extra=extra, resume=f.dir) for f in first]
        _finish(again)
    finally:
        for f in [*first, *again]:
            f.kill()
        hub.stop()
        copies.stop()
    assert 2 <= meta["version"] < 4, meta["version"]
    assert f"at version {meta['version']}" in hub.log.read_text(), hub.log.read_text()
    _check_commit_from_saved(meta, tensors, again, back)
    assert _check_one_history(hub, again, copies.load(), back) > meta["version"]


# ---------------------------------------------------------------------------------------------------- identity
def _probe(hub: Hub, ca: Path, cert: Path | None, key: Path | None) -> None:
    """The launcher's check (the hub's Join with ``probe``), from here over TLS with this identity."""
    import grpc

    from xffl_like.hub.protocol.wire import SERVICE, pack, unpack

    creds = grpc.ssl_channel_credentials(ca.read_bytes(), key and key.read_bytes(), cert and cert.read_bytes())
    with grpc.secure_channel(hub.address, creds) as channel:
        spec = {
            "parameters": [["w", [6], "float32"]],
            "outer": {},
            "compression": {"kind": "none"},
            "grace_s": 60.0,
            "max_norm_ratio": 10.0,
        }  # a probe's description is checked too (its keys, their types and bounds)
        msg = {"spec": spec, "session": "probe", "steps": 2, "probe": True,
               "geometry": {"batch_size": 4, "seq_len": 64, "dp": 1}}  # fmt: skip
        out = unpack(channel.unary_unary(f"/{SERVICE}/Join")(pack(msg), timeout=20))
    assert out["status"] == "ok", out


def _identity(certs: Path, name: str, ca: Path | None = None) -> list[str]:
    return [
        f"federation.elastic.ca={ca or certs / 'ca.crt'}",
        f"federation.elastic.cert={certs / 'facilities' / f'{name}.crt'}",
        f"federation.elastic.key={certs / 'facilities' / f'{name}.key'}",
    ]


def test_identities_refused_in_one_line_and_the_hub_serves_on(certs, tmp_path):
    hub = Hub(tmp_path, certs)
    try:
        other = init_certs(tmp_path / "other-ca", ["a"])
        _hub_cli("revoke", str(certs), "gone")  # while the hub runs: refused from its next connection
        nobody = f"localhost:{free_port()}"  # nothing listens there
        cases = {  # case: (hub, identity, what its one line names)
            "plaintext": (f"127.0.0.1:{hub.port}", ["federation.elastic.facility=a"], [f"127.0.0.1:{hub.port}"]),
            "another CA": (hub.address, _identity(other, "a"), [hub.address]),
            "signed by another CA": (hub.address, _identity(other, "a", ca=certs / "ca.crt"), ["a.crt", "ca.crt"]),
            "revoked": (hub.address, _identity(certs, "gone"), [hub.address, "revoked"]),
            # refused before dialling: the name, not an unreachable hub
            "name": (nobody, [*_identity(certs, "a"), "federation.elastic.facility=b"], ["facility=b", "'a'"]),
        }
        procs = {}
        for case, (address, identity, _) in cases.items():
            args = [
                "+experiment=llama_fed",
                "logger=none",
                "distributed.federated=null",
                "distributed.nproc_per_node=1",
                f"federation.elastic.hub={address}",
                "federation.elastic.timeout_s=20",
                *identity,
                *TINY,
                f"hydra.run.dir={tmp_path / re.sub(r'[^a-z]', '-', case)}",
            ]
            procs[case] = subprocess.Popen(
                [sys.executable, "-m", "xffl_like.run", *args], cwd=REPO, env=ENV, text=True,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        try:
            outs = {case: p.communicate(timeout=120) for case, p in procs.items()}
        finally:
            for p in procs.values():
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for case, (_, _, words) in cases.items():
            out, err = outs[case]
            lines = [line for line in err.splitlines() if line.strip()]
            assert procs[case].returncode not in (0, None), case
            assert len(lines) == 1 and lines[0].startswith("error: "), f"{case}: {err}"
            for word in words:
                assert word in lines[0], f"{case}: {word!r} not in {lines[0]}"
            assert "loss" not in out, f"{case}: it trained:\n{out}"
        assert "the hub at" not in outs["name"][1], outs["name"][1]
        assert hub.proc.poll() is None, hub.logs()
        # From here: a good identity is admitted; none, or one from another CA, or a revoked one is not.
        import grpc

        mine = certs / "facilities"
        _probe(hub, certs / "ca.crt", mine / "a.crt", mine / "a.key")
        for cert, key in ((None, None), (other / "facilities" / "a.crt", other / "facilities" / "a.key")):
            with pytest.raises(grpc.RpcError):
                _probe(hub, certs / "ca.crt", cert, key)
        with pytest.raises(grpc.RpcError, match="revoked"):
            _probe(hub, certs / "ca.crt", mine / "gone.crt", mine / "gone.key")
        _probe(hub, certs / "ca.crt", mine / "b.crt", mine / "b.key")
        assert hub.stop() == 0, hub.logs()
    finally:
        hub.kill()
