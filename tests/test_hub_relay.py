"""Issue 37 item 2: with compression, a round's result is relayed (the other accepted facilities' messages), and
every facility applies the mean and the outer step itself. In one process: a real gRPC hub on a free loopback
port (``--insecure``) and three facilities' leaders (:class:`ElasticFederation` with a :class:`HubLink`, its
round's leader side, no process group), two top-k rounds with Nesterov. The test decodes the messages with
numpy (not the codec), computes both rounds by hand, and checks the hub's saved θ_global and outer state and
every facility's copy bitwise against it; a relay that lies about a size, the order or the version is refused in
one line and the facility heals; and a facility's download per round is (F-1) messages plus a small header."""

from __future__ import annotations

import dataclasses
import math
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest
import torch
from helpers import REPO
from helpers.hub import serve, wait_for
from helpers.sparseloco_reference import ref_decode

from xffl_like.config.schema import ElasticConfig, FederationConfig, OuterConfig, TopkConfig
from xffl_like.federation.elastic import exchange
from xffl_like.hub.client import HubLink
from xffl_like.hub.server import relayed, store
from xffl_like.hub.server.federation import HubFederation

NAMES = ("a", "b", "c")
N, CHUNK, DENSITY, BITS = 64 * 40 + 20, 64, 0.125, 2  # top-k: 43 runs of 60 (2580's divisor <= 64), 8 kept
LR, MOMENTUM = 0.7, 0.9
TOKENS = {"a": 12.0, "b": 20.0, "c": 28.0}  # token weights: 12/60, 20/60, 28/60
GEOMETRY = {"batch_size": 2, "seq_len": 8, "dp": 1}
HEADER_BYTES = 2048  # a relay's JSON header, generously


def _spec(aggregate: str = "mean") -> dict:
    return {
        "parameters": [["w", [N], "float32"]],
        "algorithm": "federated",
        "outer": {
            "name": "nesterov",
            "lr": LR,
            "momentum": MOMENTUM,
            "betas": [0.9, 0.99],
            "eps": 1e-8,
            "offload": False,
        },  # fmt: skip
        "compression": {
            "kind": "topk",
            "chunk_size": CHUNK,
            "error_feedback": True,
            "density": DENSITY,
            "bits": BITS,
            "decay": 0.95,
            "chunks": "tiles",
            "quantizer": "bins",
            "mean": "senders",
        },  # fmt: skip
        "every_s": None,
        "rounds": 10,
        "train.steps": None,
        "weights": "tokens",
        "grace_s": 60.0,
        "max_norm_ratio": 10.0,
        "aggregate": aggregate,
        "trim": 0.2,
        "weights_rule": "tokens",
        "paced": False,
        "min_facilities": 1,
    }


def _config(address: str, name: str, aggregate: str = "mean") -> FederationConfig:
    return FederationConfig(
        every=2,
        weights="tokens",
        outer=OuterConfig(name="nesterov", lr=LR, momentum=MOMENTUM),
        compression="topk",
        chunk_size=CHUNK,
        error_feedback=True,
        topk=TopkConfig(density=DENSITY, bits=BITS, decay=0.95),
        elastic=ElasticConfig(hub=address, facility=name, timeout_s=30.0, aggregate=aggregate),
    )


class Hub:
    """A hub on a free loopback port over a fresh federation."""

    def __init__(self, state: Path):
        self.fed = HubFederation(state, None, log=lambda _: None)
        self.server, port = serve(self.fed)
        self.address = f"127.0.0.1:{port}"

    def saved(self):
        """The hub's latest version (θ_global, the outer buffers), read back from its file once written (its
        checksums checked)."""
        return self.fed.store.load(self.fed.saved().version)

    def close(self) -> None:
        self.server.stop(grace=None)
        self.fed.close()


def _facility(hub: Hub, tmp: Path, name: str, aggregate: str = "mean") -> exchange.ElasticFederation:
    """A facility's leader: its round's leader side, with its own spool, over a one-parameter model."""
    cfg = _config(hub.address, name, aggregate)
    link = HubLink(cfg.elastic, name, _spec(aggregate), GEOMETRY, steps=20, every=2)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.zeros(N))
    state = SimpleNamespace(rank=0, device=torch.device("cpu"))
    return exchange.ElasticFederation(cfg, model, state, name, 20, link=link, spool=tmp / f"spool-{name}")


def _parallel(work: dict) -> dict:
    """``work[name]()`` for every name at once (the members of one round); their results."""
    out, errors = {}, []

    def run(name):
        try:
            out[name] = work[name]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert set(out) == set(work), "a member did not finish its round"
    return out


def _round(facilities: dict, done: int, seed: int) -> dict:
    """Every facility trains (θ_global minus a random step) and takes the round at step ``done``."""
    gen = np.random.default_rng(seed)
    for f in facilities.values():
        theta = np.fromfile(f.files.theta, dtype=np.float32)
        (theta - gen.standard_normal(N).astype(np.float32) * 0.01).astype(np.float32).tofile(f.files.mine)

    def lead(name):
        f = facilities[name]
        out = f._lead(TOKENS[name], done, joining=False)
        f.round, f.last_step = out["round"], done
        return {**out, "message": f.files.message.read_bytes()}

    return _parallel({n: (lambda n=n: lead(n)) for n in facilities})


def _federation(tmp: Path, aggregate: str = "mean") -> tuple[Hub, dict]:
    """A hub and three facilities joined to it: ``a`` creates the federation with random parameters."""
    hub = Hub(tmp / "state")
    facilities = {n: _facility(hub, tmp, n, aggregate) for n in NAMES}
    _join_all(facilities)
    return hub, facilities


def _join_all(facilities: dict) -> None:
    """``a`` creates the federation with random parameters; the others join it."""
    np.random.default_rng(0).standard_normal(N).astype(np.float32).tofile(facilities["a"].files.mine)
    for name, f in facilities.items():
        out = f._lead(0.0, 0, joining=True)
        assert out["status"] == ("created" if name == "a" else "joined"), out
        f.round = out["round"]


def _close(hub: Hub, facilities: dict) -> None:
    for f in facilities.values():
        f.link.leave()
    hub.close()


def _decode(message: bytes) -> tuple[np.ndarray, np.ndarray]:
    """A top-k message decoded by hand from its format (tests/helpers/sparseloco_reference.py, not the codec): the
    values and a mask of those sent."""
    return ref_decode(message, [(N,)], DENSITY, 64, BITS)


def _fused() -> bool:
    """Whether this torch's CPU kernels fuse ``a + alpha x b`` into one rounding (the outer step's ``alpha=``)."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(1 << 12, generator=g), torch.randn(1 << 12, generator=g)
    return not torch.equal(a.clone().add_(b, alpha=0.7), a + b * 0.7)


def _muladd(x: np.ndarray, alpha: float, y: np.ndarray, fused: bool) -> np.ndarray:
    """``y + alpha x`` in float32: one rounding (an exact product in float64, then one sum) or two."""
    a = np.float32(alpha)
    if fused:
        return (x.astype(np.float64) * np.float64(a) + y.astype(np.float64)).astype(np.float32)
    return y + x * a


def _by_hand(theta: np.ndarray, buf: np.ndarray, messages: dict, weights: dict | None, fused: bool):
    """One round: per index the weighted mean of the decoded messages over the members that sent it, in name order
    (each weight x value rounded, then added, the weights of the senders summed alike, then divided; ``weights``
    None: the coordinate-wise median of the decoded messages, 0 where not sent), then Nesterov
    (torch.optim.SGD(nesterov=True)'s rule) on it, in float32."""
    mean, den = np.zeros(N, dtype=np.float32), np.zeros(N, dtype=np.float32)
    if weights is None:
        mean = np.median(np.stack([_decode(messages[n])[0] for n in sorted(messages)]), axis=0).astype(np.float32)
    for name in sorted(messages) if weights is not None else ():
        values, sent = _decode(messages[name])
        mean = mean + np.float32(weights[name]) * values
        den = den + np.float32(weights[name]) * sent.astype(np.float32)
    if weights is not None:
        assert (den > 0).any() and (den < 1).any()  # some values sent by some members only
        mean = mean / np.where(den > 0, den, np.float32(1))
    buf = buf * np.float32(MOMENTUM) + mean
    step = _muladd(buf, MOMENTUM, mean, fused)
    return _muladd(step, -LR, theta, fused), buf


@pytest.fixture(scope="module")
def two_rounds(tmp_path_factory):
    """Two compressed rounds of three facilities: after each, the hub's saved state, every facility's files, the
    results and the relays each facility received (captured before it applied them)."""
    tmp = tmp_path_factory.mktemp("relay")
    relays: dict = {}
    apply = exchange.apply_relay

    def capture(theta, outer, own, received, *, me, header, **kw):
        relays[me] = (header, Path(received).read_bytes())
        return apply(theta, outer, own, received, me=me, header=header, **kw)

    exchange.apply_relay = capture
    hub, facilities = _federation(tmp)
    start = hub.saved()
    rounds = []
    try:
        for r in range(2):
            relays.clear()
            outs = _round(facilities, 2 * (r + 1), seed=10 + r)
            saved = hub.saved()
            files = {n: (np.fromfile(f.files.theta, dtype=np.float32), np.fromfile(f.files.outer, dtype=np.float32))
                     for n, f in facilities.items()}  # fmt: skip
            rounds.append(SimpleNamespace(outs=outs, saved=saved, files=files, relays=dict(relays)))
    finally:
        exchange.apply_relay = apply
        nbytes = facilities["a"].codec.nbytes
        _close(hub, facilities)
    return SimpleNamespace(start=start, rounds=rounds, message_bytes=nbytes)


def test_two_relayed_rounds_by_hand_and_every_copy_bitwise(two_rounds):
    """Both rounds recomputed by hand (numpy decode of the messages the facilities sent, the token-weighted mean,
    Nesterov) equal the hub's saved θ_global and momentum buffer, and every facility's copy, bit for bit."""
    fused = _fused()
    theta, buf = two_rounds.start.theta.numpy(), np.zeros(N, dtype=np.float32)
    assert two_rounds.start.outer_steps == 0
    for r, rnd in enumerate(two_rounds.rounds):
        total = sum(TOKENS.values())
        weights = {n: TOKENS[n] / total for n in NAMES}
        for out in rnd.outs.values():
            assert out["status"] == "accepted" and out["relay"] is not None, out
            assert out["weights"] == weights and out["round"] == r + 1
        theta, buf = _by_hand(theta, buf, {n: o["message"] for n, o in rnd.outs.items()}, weights, fused)
        assert not np.array_equal(theta, two_rounds.start.theta.numpy())
        assert rnd.saved.version == r + 1 and rnd.saved.outer_steps == r + 1
        np.testing.assert_array_equal(rnd.saved.theta.numpy(), theta)
        np.testing.assert_array_equal(rnd.saved.buffers["momentum_buffer"].numpy(), buf)
        for name, (f_theta, f_outer) in rnd.files.items():
            np.testing.assert_array_equal(f_theta, theta, err_msg=f"facility {name}'s θ_global, round {r + 1}")
            np.testing.assert_array_equal(f_outer, buf, err_msg=f"facility {name}'s momentum buffer, round {r + 1}")


def test_the_relay_is_the_other_members_messages_in_fold_order(two_rounds):
    """What a facility receives is the other accepted members' messages, byte for byte, in name order, with the
    header's claims: the version it holds, every member and its weight, the sizes, the outer step."""
    for r, rnd in enumerate(two_rounds.rounds):
        for me in NAMES:
            header, received = rnd.relays[me]
            assert header.base == r and header.outer_steps == r + 1 and header.order == NAMES
            assert received == b"".join(rnd.outs[n]["message"] for n in NAMES if n != me)
            assert header.sizes == tuple(0 if n == me else two_rounds.message_bytes for n in NAMES)
            assert math.isclose(math.fsum(header.weights), 1.0, abs_tol=1e-12)


def test_a_facility_downloads_the_other_messages_and_a_small_header(two_rounds):
    """Per round and facility: up one message, down (F-1) messages plus a small header (counted bytes), against
    θ_global in full (4 bytes a parameter, and its momentum buffer) before."""
    message = two_rounds.message_bytes
    for rnd in two_rounds.rounds:
        for name, out in rnd.outs.items():
            assert out["bytes_up"] == message, (name, out["bytes_up"])
            assert (len(NAMES) - 1) * message <= out["bytes_down"] <= (len(NAMES) - 1) * message + HEADER_BYTES
            assert out["bytes_down"] < 4 * N / 5  # θ_global in full would be 4 N bytes
            assert out["bytes"] == out["bytes_up"] + out["bytes_down"]


def _tamper(kind: str, victim: str):
    """A wrong claim in the relay the hub sends ``victim`` (or its bytes): ``kind`` names it."""
    header, opened = relayed.Relayed.header, relayed.Relayed.open

    def lying_header(self, name):
        h = header(self, name)
        if name != victim:
            return h
        if kind == "size":
            return type(h)(h.base, h.order, h.weights, tuple(s + 4 if s else 0 for s in h.sizes), h.outer_steps)
        if kind == "order":
            return type(h)(h.base, h.order[::-1], h.weights[::-1], h.sizes[::-1], h.outer_steps)
        if kind == "version":
            return type(h)(h.base + 1, h.order, h.weights, h.sizes, h.outer_steps)
        return h

    def lying_bytes(self, name):
        files = opened(self, name)
        if name != victim or kind != "values":
            return files
        import io

        data = bytearray(files[0][0].read())
        data[0:4] = np.array([np.nan], dtype=np.float32).tobytes()  # the tensor's shift
        files[0][0].close()
        return [(io.BytesIO(bytes(data)), len(data)), *files[1:]]

    return lying_header, lying_bytes


@pytest.mark.parametrize(
    ("kind", "line"),
    [
        ("size", "relay message of a is"),
        ("order", "is not the hub's fold order"),
        ("version", "but this facility holds version 0"),
        ("values", "header holds a non-finite value"),
    ],
)
def test_a_relay_that_does_not_match_is_refused_in_one_line_and_the_facility_heals(tmp_path, capsys, monkeypatch,
                                                                                     kind, line):  # fmt: skip
    """A relay whose message size, order or version does not match what the facility holds, or whose message
    decodes to a value that is not finite, changes nothing there: one line, then θ_global and the outer state in
    full (bitwise the hub's); the other facilities apply theirs."""
    lying_header, lying_bytes = _tamper(kind, "b")
    monkeypatch.setattr(relayed.Relayed, "header", lying_header)
    monkeypatch.setattr(relayed.Relayed, "open", lying_bytes)
    hub, facilities = _federation(tmp_path)
    try:
        outs = _round(facilities, 2, seed=3)
        saved = hub.saved()
        held = {n: (np.fromfile(f.files.theta, dtype=np.float32), np.fromfile(f.files.outer, dtype=np.float32))
                for n, f in facilities.items()}  # fmt: skip
        monkeypatch.undo()  # the next round's relay is honest: b applies it from the state it healed to
        again = _round(facilities, 4, seed=4)
        later = hub.saved()
    finally:
        _close(hub, facilities)
    said = [x for x in capsys.readouterr().out.splitlines() if "relay does not match" in x]
    assert len(said) == 1 and said[0].startswith("facility b: the hub's relay does not match") and line in said[0], said
    assert said[0].endswith("it heals (downloads θ_global in full)")
    assert outs["b"]["status"] == "healed" and outs["b"]["round"] == 1
    message = facilities["a"].codec.nbytes  # b's download: the relay it refused, then θ_global and the momentum
    assert outs["b"]["bytes_down"] > 2 * message + 4 * N * 2 and outs["b"]["bytes_up"] == message
    assert [outs[n]["status"] for n in ("a", "c")] == ["accepted", "accepted"]
    for name, (theta, outer) in held.items():
        np.testing.assert_array_equal(theta, saved.theta.numpy(), err_msg=name)
        np.testing.assert_array_equal(outer, saved.buffers["momentum_buffer"].numpy(), err_msg=name)
    assert all(o["status"] == "accepted" and o["relay"] is not None for o in again.values()), again
    for name, f in facilities.items():
        np.testing.assert_array_equal(np.fromfile(f.files.theta, dtype=np.float32), later.theta.numpy(), err_msg=name)
        outer = later.buffers["momentum_buffer"].numpy()
        np.testing.assert_array_equal(np.fromfile(f.files.outer, dtype=np.float32), outer, err_msg=name)
        assert f.outer_steps == 2 and f.link.version == 2
    assert not any(p.name.endswith((".next", ".part")) for p in (tmp_path / "spool-b").iterdir())
    shutil.rmtree(tmp_path / "state", ignore_errors=True)


def test_a_relayed_median_round_by_hand(tmp_path):
    """``federation.elastic.aggregate=median``: the relayed round is the coordinate-wise median of the decoded
    messages (unweighted: each weight 1/3), then Nesterov, by hand, bitwise at the hub and at every facility."""
    hub, facilities = _federation(tmp_path, "median")
    try:
        theta = hub.saved().theta.numpy()
        outs = _round(facilities, 2, seed=5)
        saved = hub.saved()
    finally:
        _close(hub, facilities)
    assert all(o["status"] == "accepted" and o["relay"].weights == (1 / 3,) * 3 for o in outs.values()), outs
    messages = {n: o["message"] for n, o in outs.items()}
    expected, buf = _by_hand(theta, np.zeros(N, dtype=np.float32), messages, None, _fused())
    np.testing.assert_array_equal(saved.theta.numpy(), expected)
    np.testing.assert_array_equal(saved.buffers["momentum_buffer"].numpy(), buf)
    for name, f in facilities.items():
        np.testing.assert_array_equal(np.fromfile(f.files.theta, dtype=np.float32), expected, err_msg=name)


def _eager_federation(tmp: Path, rounds: int) -> tuple[Hub, dict]:
    """A hub and three facilities of a compressed ``delay=1`` eager federation of ``rounds`` rounds (every 2 steps):
    the hub's rule is the carrier (average at lr 1), the facilities' own Nesterov is ``delay_outer``."""
    carrier = {**_spec()["outer"], "name": "average", "lr": 1.0, "momentum": 0.0}
    spec = {**_spec(), "outer": carrier, "delay_outer": _spec()["outer"], "delay": 1, "delay_rule": "eager",
            "rounds": rounds}  # fmt: skip
    hub = Hub(tmp / "state")
    facilities = {}
    for name in NAMES:
        cfg = dataclasses.replace(_config(hub.address, name), outer=OuterConfig(name="average", lr=1.0), delay=1)
        link = HubLink(cfg.elastic, name, spec, GEOMETRY, steps=2 * rounds, every=2)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.zeros(N))
        state = SimpleNamespace(rank=0, device=torch.device("cpu"))
        f = exchange.ElasticFederation(cfg, model, state, name, 2 * rounds, link=link, spool=tmp / f"spool-{name}")
        facilities[name] = f
    _join_all(facilities)
    return hub, facilities


def test_the_final_round_of_a_compressed_eager_federation_carries_fp32_parameters(tmp_path):
    """Under ``delay=1`` with ``delay_rule=eager`` (issue 37 item 5) every round but the last is relayed, and the
    last carries fp32 parameters (each facility's end): the hub's final θ_global is their token-weighted sum in
    name order (the carrier: average at lr 1), by hand, bitwise at the hub and at every facility, which downloads
    it in full (no relay, no message sent: 4 bytes a parameter up)."""
    hub, facilities = _eager_federation(tmp_path, rounds=2)
    try:
        first = _round(facilities, 2, seed=6)
        assert all(o["status"] == "accepted" and o["relay"] is not None for o in first.values()), first
        theta = hub.saved().theta.numpy()
        gen = np.random.default_rng(7)
        ends = {n: (theta - gen.standard_normal(N).astype(np.float32)).astype(np.float32) for n in NAMES}
        for name, f in facilities.items():
            ends[name].tofile(f.files.mine)

        def lead(name):
            f = facilities[name]
            return f._lead(TOKENS[name], 4, joining=False)

        last = _parallel({n: (lambda n=n: lead(n)) for n in facilities})
        saved = hub.saved()
    finally:
        _close(hub, facilities)
    total = sum(TOKENS.values())
    expected = torch.zeros(N)
    for name in NAMES:
        expected.add_(torch.from_numpy(ends[name]), alpha=TOKENS[name] / total)  # the hub's fp32 fold
    assert saved.version == 2 and saved.ended
    np.testing.assert_array_equal(saved.theta.numpy(), expected.numpy())
    for name, f in facilities.items():
        out = last[name]
        assert out["status"] == "accepted" and out["relay"] is None and out["ended"], out
        assert out["bytes_up"] == 4 * N and out["bytes_down"] >= 4 * N, out
        np.testing.assert_array_equal(np.fromfile(f.files.theta, dtype=np.float32), saved.theta.numpy(), err_msg=name)


def test_an_upload_of_the_other_kind_than_its_round_is_refused_before_it_is_spooled(tmp_path):
    """The hub decides a round's upload size from its own count: a message in the final round of a compressed eager
    federation (which takes fp32 parameters), or fp32 parameters in a compressed round, is refused in one line."""
    from xffl_like.hub.protocol.messages import UploadHeader
    from xffl_like.hub.protocol.wire import Frames, WireError

    for rounds, wrong, right in ((1, "message", "parameters"), (2, "parameters", "message")):
        hub, facilities = _eager_federation(tmp_path / f"r{rounds}", rounds=rounds)
        try:
            a = facilities["a"]
            sizes = {"message": a.codec.nbytes, "parameters": 4 * N}
            rid = a.link.unary("Arrive", version=0, step=2, taken=2, tokens=TOKENS["a"]).round
            for kind in (wrong, right):
                header = UploadHeader(session=a.link.session, kind="round", round=rid, nbytes=sizes[kind])
                if kind == right:
                    Frames(iter([header.encode()]), hub.fed.expected_bytes, UploadHeader)
                    continue
                with pytest.raises(WireError) as info:
                    Frames(iter([header.encode()]), hub.fed.expected_bytes, UploadHeader)
                assert str(info.value) == f"{sizes[wrong]} bytes announced, expected {sizes[right]}"
        finally:
            _close(hub, facilities)


# ------------------------------------------------------------------ the record first, θ_global's file behind it
def _copies(facilities: dict) -> dict:
    return {n: (np.fromfile(f.files.theta, dtype=np.float32), np.fromfile(f.files.outer, dtype=np.float32))
            for n, f in facilities.items()}  # fmt: skip


def _all_equal(saved, copies: dict, theta: np.ndarray, buf: np.ndarray) -> None:
    """The hub's saved version (unless None) and every facility's copy hold ``theta`` and the momentum ``buf``."""
    held = {**({"the hub": (saved.theta.numpy(), saved.buffers["momentum_buffer"].numpy())} if saved else {}),
            **copies}  # fmt: skip
    for name, (f_theta, f_outer) in held.items():
        np.testing.assert_array_equal(f_theta, theta, err_msg=name)
        np.testing.assert_array_equal(f_outer, buf, err_msg=name)


def _behind(state: Path, version: int) -> bool:
    """Whether ``version`` is committed by its record while its file is not written."""
    return (state / "journal" / f"{version:010d}.json").exists() and not (
        state / f"state-{version:010d}.safetensors").exists()  # fmt: skip


def test_members_apply_the_relay_before_the_hub_has_written_the_versions_file(tmp_path, monkeypatch):
    """A compressed round commits by its record (the accepted messages and a small JSON file, durable): every member
    receives its relay and applies the round while the hub's file of that version is not written yet (held here),
    and the file written behind it is, bitwise, the round by hand and every member's copy."""
    release, behind = threading.Event(), HubFederation._write_behind

    def held(self):
        release.wait(timeout=120)
        behind(self)

    lines: list[str] = []
    hub, facilities = _federation(tmp_path)
    hub.fed.log = lines.append
    state, theta = tmp_path / "state", hub.saved().theta.numpy().copy()
    monkeypatch.setattr(HubFederation, "_write_behind", held)
    try:
        outs = _round(facilities, 2, seed=31)
        assert all(o["status"] == "accepted" and o["relay"] is not None for o in outs.values()), outs
        assert hub.fed.version == 1 and hub.fed.snap.version == 0  # committed; its file not written
        assert _behind(state, 1)
        copies = _copies(facilities)
        release.set()
        saved = hub.saved()
    finally:
        release.set()
        _close(hub, facilities)
    total = sum(TOKENS.values())
    messages = {n: o["message"] for n, o in outs.items()}
    expected, buf = _by_hand(theta, np.zeros(N, dtype=np.float32), messages, {n: TOKENS[n] / total for n in NAMES},
                             _fused())  # fmt: skip
    assert saved.version == 1 and saved.outer_steps == 1
    _all_equal(saved, copies, expected, buf)
    assert not (state / "journal" / "0000000001.json").exists()  # the record goes once the file is durable
    assert any("committed version 1: a, b, c" in x and "its record: the file is written behind it" in x for x in lines)
    assert any(x.startswith("hub: version 1's file written behind its record") for x in lines), lines


def test_a_disk_without_room_refuses_the_compressed_round_before_its_record(tmp_path, monkeypatch):
    """No room for the next version's file: the round is refused before anything commits (no record, the saved
    version intact, every member told ``missed`` and keeping its state); the next round, with room, commits."""
    hub, facilities = _federation(tmp_path)
    state = tmp_path / "state"
    before = (state / "state-0000000000.safetensors").read_bytes()

    def no_room(directory, nbytes):
        raise store.NoRoom(f"--state {directory} has 0 bytes free; the next version needs {nbytes}")

    try:
        held = _copies(facilities)
        with monkeypatch.context() as patch:
            patch.setattr(store, "room", no_room)
            outs = _round(facilities, 2, seed=32)
        assert {o["status"] for o in outs.values()} == {"missed"}, outs
        assert hub.fed.version == 0 and not list(state.glob("journal/*"))
        assert (state / "state-0000000000.safetensors").read_bytes() == before
        for name, (theta, _) in _copies(facilities).items():
            np.testing.assert_array_equal(theta, held[name][0], err_msg=name)
        for f in facilities.values():  # the round at the federation's step 2 again, 2 steps from the start
            f.last_step = 0
        again = _round(facilities, 2, seed=33)
        assert all(o["status"] == "accepted" for o in again.values()) and hub.saved().version == 1, again
    finally:
        _close(hub, facilities)


_HUB = """
import sys, time
sys.path[:0] = [{tests!r}]
from pathlib import Path
from helpers.hub import serve
from xffl_like.hub.server import store
from xffl_like.hub.server.federation import HubFederation
from xffl_like.hub.server.serve import line_log

say = line_log()  # the hub's log: the committer's line and the log's never interleave within a line

if {hang!r}:  # the committer stops between a round's record and its file: the process is killed there
    def hang(self):
        say(f"BEHIND {{self.behind.record.version}}")
        time.sleep(600)
    HubFederation._write_behind = hang
state = Path({state!r})
fed = HubFederation(state, store.load_latest(state) if state.exists() else None, log=say)
want, port = {port}, 0
for _ in range(100):  # the port of the hub killed before it: free once that process is gone
    try:
        server, port = serve(fed, port=want)
    except RuntimeError:
        port = 0
    if port:
        break
    time.sleep(0.1)
say(f"PORT {{port}}")
time.sleep(600)
"""


class _HubProcess:
    """A hub in its own process on ``port`` (0: a free one, :attr:`port`) over ``state`` (``hang``: its committer
    never writes a file behind its record); its log lines collected as they come."""

    def __init__(self, state: Path, port: int, hang: bool):
        code = _HUB.format(tests=str(REPO / "tests"), state=str(state), port=port, hang=hang)
        self.proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        self.port = int(self.said("PORT ").split()[1])
        assert self.port and port in (0, self.port), self.lines

    def said(self, start: str) -> str:
        """The first line the hub said that starts with ``start`` (waited for)."""

        def line():
            return next((x.strip() for x in self.lines if x.startswith(start)), None)

        wait_for(lambda: line() is not None or self.proc.poll() is not None, 240, f"{start!r} among {self.lines}")
        assert line() is not None, self.lines
        return line()

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


def test_a_hub_killed_between_a_rounds_record_and_its_file_replays_the_record(tmp_path):
    """A hub process SIGKILLed once round 1's record is durable and its members applied the relay, before the
    version's file: started again on the same ``--state`` it writes that file from the record (a damaged message
    refused in one line instead), and round 2 relays on it; both rounds by hand equal the hub's file and every
    member's copy, bitwise."""
    state = tmp_path / "state"
    first = _HubProcess(state, 0, hang=True)
    address = SimpleNamespace(address=f"127.0.0.1:{first.port}")
    facilities = {n: _facility(address, tmp_path, n) for n in NAMES}
    second = None
    try:
        _join_all(facilities)
        theta = store.load_latest(state).theta.numpy().copy()
        one = _round(facilities, 2, seed=34)
        assert all(o["status"] == "accepted" for o in one.values()), (one, first.lines)
        first.said("BEHIND 1")
        assert _behind(state, 1)
        first.kill()
        damaged = tmp_path / "damaged"
        shutil.copytree(state, damaged)
        with open(damaged / "journal" / "0000000001-b.bin", "r+b") as fh:
            byte = fh.read(1)
            fh.seek(0)
            fh.write(bytes([byte[0] ^ 1]))
        with pytest.raises(store.StateError, match=r"0000000001\.json: facility b's message 0000000001-b\.bin is "
                                                   r"missing or damaged: remove it"):  # fmt: skip
            HubFederation(damaged, store.load_latest(damaged), log=lambda _: None)
        second = _HubProcess(state, first.port, hang=False)
        assert any("hub: version 1 (round 0) was committed by its record: its file is written" in x
                   for x in second.lines), second.lines  # fmt: skip
        copies = _copies(facilities)
        for f in facilities.values():  # members of the hub before: each joins the restarted hub again
            grpc.channel_ready_future(f.link.channel).result(timeout=60)
            out = f._lead(0.0, 2, joining=True)
            assert out["status"] == "joined" and f.link.version == 1, out
        two = _round(facilities, 4, seed=35)
        wait_for(lambda: (state / "state-0000000002.safetensors").exists(), 240, "version 2's file")
        saved = store.load_latest(state)
        applied, copies = copies, _copies(facilities)
    finally:
        for f in facilities.values():
            f.link.leave()
        first.kill()
        if second is not None:
            second.kill()
    total = sum(TOKENS.values())
    weights, buf = {n: TOKENS[n] / total for n in NAMES}, np.zeros(N, dtype=np.float32)
    by_hand = []
    for outs in (one, two):
        assert all(o["status"] == "accepted" and o["relay"] is not None for o in outs.values()), outs
        theta, buf = _by_hand(theta, buf, {n: o["message"] for n, o in outs.items()}, weights, _fused())
        by_hand.append((theta, buf))
    _all_equal(None, applied, *by_hand[0])  # round 1's relay, applied before the kill
    assert saved.version == 2 and saved.outer_steps == 2
    _all_equal(saved, copies, theta, buf)
