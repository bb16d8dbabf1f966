"""Issue 37, item 4: the hub folds a round's fp32 uploads into the next version while they stream in
(:mod:`xffl_like.hub.server.ahead`). In one process: a real gRPC server on a free loopback port over a fresh
:class:`HubFederation`, three members as raw clients whose uploads are held half-way (their first windows
spooled, the rest not sent) until the test lets each finish, in reverse name order.

The committed θ_global, as saved and as a member downloads it, is checked against the test's own computation
from the uploads it sent: numpy in float64 (the mean or the median over members, then Nesterov's step), to
1e-6 (the hub computes in fp32: a few roundings of values near 1); and bitwise against the documented order,
the fp32 products summed in name order from zero whatever the order of arrival (which, for three members at
1/3 each, is not the arrival order's sum). A contribution rejected by the norm check after it was folded ahead
leaves no trace: the version is bitwise the two others' round, and no file of the unfinished one is left; one
broken off half-way is folded out, the others folded ahead again without it."""

from __future__ import annotations

import re
import threading

import grpc
import numpy as np
import pytest
import torch
from helpers.hub import serve, wait_for
from test_hub_robust import Raw

from xffl_like.bench.hub_drift import spec_of
from xffl_like.config.schema import OuterConfig
from xffl_like.federation.outer import OuterOptimizer
from xffl_like.hub.protocol.wire import GRPC_OPTIONS, SERVICE, pack, unpack
from xffl_like.hub.server import federation as hub_federation
from xffl_like.hub.server import store
from xffl_like.hub.server.federation import HubFederation
from xffl_like.hub.server.fold import UNIT

NUMEL = 4 * UNIT + 4321  # five windows of UNIT values (the last one short)
HELD = 2 * UNIT  # values each upload sends before it is held
LR, MOMENTUM = 0.7, 0.9
NAMES = ("a", "b", "c")


def _spec(aggregate: str) -> dict:
    spec = spec_of(NUMEL, aggregate=aggregate)
    spec["outer"] = {**spec["outer"], "name": "nesterov", "lr": LR, "momentum": MOMENTUM}
    return spec


def _theta0() -> torch.Tensor:
    return torch.linspace(-1, 1, NUMEL, dtype=torch.float32)


def _uploads(rejected: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = {n: _theta0() + 0.01 * torch.randn(NUMEL, generator=g) for n in NAMES}
    if rejected:  # c's update is far over 10x the others' norms: the checks at the close reject it
        out["c"] = _theta0() + 1000.0 * torch.randn(NUMEL, generator=g)
    return out


def _held(member: Raw, rid: int, values: torch.Tensor, gate: threading.Event, replies: dict) -> threading.Thread:
    """``member``'s upload in a thread: its first :data:`HELD` values, then the rest once ``gate`` is set (or the
    call broken off there, when ``replies`` already names ``member``)."""
    raw = values.view(torch.uint8).numpy()

    def frames():
        header = {"session": member.session, "facility": member.name, "kind": "round", "round": rid}
        yield pack({**header, "nbytes": raw.size})
        yield raw[: 4 * HELD].tobytes()
        gate.wait(60)
        if member.name in replies:  # told to break off: the client cancels the call
            raise RuntimeError("broken off")
        yield raw[4 * HELD :].tobytes()

    def run():
        call = member.ch.stream_unary(f"/{SERVICE}/Upload")
        try:
            replies[member.name] = unpack(call(frames(), timeout=60))
        except grpc.RpcError as exc:
            replies[member.name] = {"ok": False, "error": exc.code()}

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _by_hand(ups: dict[str, torch.Tensor], names: tuple[str, ...], aggregate: str) -> np.ndarray:
    """θ_global after the round, numpy float64: the mean (uniform) or the median of ``names``' uploads, then
    Nesterov from zero momentum (``d = θ - agg``; ``buf = d``; ``θ -= lr (d + m buf)``)."""
    stack = np.stack([ups[n].double().numpy() for n in names])
    agg = stack.mean(0) if aggregate == "mean" else np.median(stack, 0)
    theta = _theta0().double().numpy()
    d = theta - agg
    return theta - LR * (d + MOMENTUM * d)


def _stepped(agg: torch.Tensor) -> torch.Tensor:
    """θ_global after a facility's whole-tensor outer step (fp32, as every facility steps) towards ``agg``."""
    opt = OuterOptimizer(OuterConfig(name="nesterov", lr=LR, momentum=MOMENTUM), _theta0())
    opt.step(torch.sub(opt.theta, agg))
    return opt.theta


def _in_order(ups: dict[str, torch.Tensor], order: tuple[str, ...], n: int) -> torch.Tensor:
    """The round's θ_global in fp32 with the mean summed in ``order`` from zero (each upload times 1/n)."""
    acc = torch.zeros(NUMEL)
    for name in order:
        acc.add_(ups[name], alpha=1.0 / n)
    return _stepped(acc)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A hub on a fresh federation, windows of :data:`UNIT` values; yields (federation, channel, log lines)."""
    monkeypatch.setattr(hub_federation, "window", lambda uploads: UNIT)
    lines: list[str] = []
    fed = HubFederation(tmp_path / "state", None, log=lines.append)
    server, port = serve(fed)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    yield fed, channel, lines
    channel.close()
    server.stop(grace=None)
    fed.close()


def _round(hub, aggregate: str, rejected: bool, broken: str | None = None):
    """Three members create and join, arrive and upload held half-way; once the hub has folded the held windows
    ahead, the uploads finish in the order c, b, a (``broken``'s is broken off first, and the hub folds the
    others' held windows again). The round's result as b reads it, and the uploads."""
    fed, channel, lines = hub
    members = [Raw(channel, n) for n in NAMES]
    for m in members:
        m.join(_spec(aggregate))
        if m.name == "a":
            m.upload("create", _theta0())
    rid = {m.arrive(0, 2)["round"] for m in members}.pop()
    ups, replies = _uploads(rejected), {}
    gates = {m.name: threading.Event() for m in members}
    threads = {m.name: _held(m, rid, ups[m.name], gates[m.name], replies) for m in members}
    wait_for(lambda: fed.ahead is not None and fed.ahead.start == HELD, 60, "the held windows folded ahead")
    assert fed.ahead.key[1] == NAMES and (fed.store.dir / ".state-0000000001.safetensors.tmp").exists()
    if broken is not None:
        replies[broken] = None  # its frames break off when its gate opens
        gates[broken].set()
        threads[broken].join(60)
        others = tuple(n for n in NAMES if n != broken)
        wait_for(lambda: fed.ahead is not None and fed.ahead.key[1] == others and fed.ahead.start == HELD, 60,
                 "the others' held windows folded ahead again")  # fmt: skip
    for name in reversed(NAMES):
        if name != broken:
            gates[name].set()
            threads[name].join(60)
    assert all(replies[n]["ok"] for n in NAMES if n != broken), replies
    header, theta = members[1].result(rid)
    return header, theta, ups


@pytest.mark.parametrize("aggregate", ["mean", "median"])
def test_a_round_folded_ahead_is_the_mean_and_outer_step_of_its_uploads(hub, aggregate):
    fed, _, lines = hub
    header, theta, ups = _round(hub, aggregate, rejected=False)
    assert header["status"] == "accepted" and header["version"] == 1, header
    assert any(re.search(r"round 0 committed version 1: a, b, c \(.*folded ahead\)", line) for line in lines), lines
    saved = store.load_latest(fed.store.dir)
    assert torch.equal(saved.theta, theta)  # what a member downloads is what the hub saved
    np.testing.assert_allclose(theta.double().numpy(), _by_hand(ups, NAMES, aggregate), rtol=0, atol=1e-6)
    if aggregate == "mean":
        assert torch.equal(theta, _in_order(ups, NAMES, 3))  # name order, not the arrival order c, b, a
        assert not torch.equal(theta, _in_order(ups, ("c", "b", "a"), 3))  # (which the test can tell apart)
    else:  # the median of three is one of them: exact
        assert torch.equal(theta, _stepped(torch.stack([ups[n] for n in NAMES]).median(0).values))


def test_a_rejected_upload_folded_ahead_leaves_no_trace(hub):
    fed, _, lines = hub
    header, theta, ups = _round(hub, "mean", rejected=True)
    assert header["status"] == "accepted" and header["version"] == 1, header
    said = [line for line in lines if "round 0 committed version 1" in line]
    assert said == [said[0]] and "a, b; rejected c" in said[0] and "folded ahead" not in said[0], lines
    assert any("facility c's contribution rejected: update norm" in line for line in lines), lines
    np.testing.assert_allclose(theta.double().numpy(), _by_hand(ups, ("a", "b"), "mean"), rtol=0, atol=1e-6)
    assert torch.equal(theta, _in_order(ups, ("a", "b"), 2))  # bitwise the round of a and b alone
    names = sorted(p.name for p in fed.store.dir.iterdir() if p.is_file())
    assert names == ["state-0000000000.safetensors", "state-0000000001.safetensors"], names
    assert not any(fed.spool.dir.iterdir())
    assert fed.ahead is None


def test_an_upload_broken_off_while_folded_ahead_is_folded_out(hub):
    """a's upload breaks off half-way, after the hub folded its first windows with b's and c's: the hub folds b's
    and c's again without it, and commits their round folded ahead, bitwise the two alone."""
    fed, _, lines = hub
    header, theta, ups = _round(hub, "mean", rejected=False, broken="a")
    assert header["status"] == "accepted" and header["version"] == 1, header
    said = r"round 0 committed version 1: b, c; rejected a \(.*folded ahead\)"
    assert any(re.search(said, line) for line in lines), lines
    why = ("upload broken off", "malformed upload")  # the call cancelled, or seen ending short
    assert any("facility a's contribution rejected: " in line and any(w in line for w in why) for line in lines)
    assert torch.equal(theta, _in_order(ups, ("b", "c"), 2))
    np.testing.assert_allclose(theta.double().numpy(), _by_hand(ups, ("b", "c"), "mean"), rtol=0, atol=1e-6)
    assert not (fed.store.dir / ".state-0000000001.safetensors.tmp").exists()
