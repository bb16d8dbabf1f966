"""The hub's rules, in one process (no gRPC): what a member at a boundary is told, and when; a facility that asks
to join a federation that has ended is refused in one line before its workers start (not trained alone from step 0
or from the last θ_global without a word)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import pytest
import torch
from helpers.hub import GEOMETRY, SPEC

from xffl_like.federation.elastic import ElasticError
from xffl_like.hub.client import HubLink
from xffl_like.hub.protocol.messages import CALLS, ArriveRequest, JoinRequest, ResultHeader, ResultRequest, UploadHeader
from xffl_like.hub.protocol.retry import RetryPolicy
from xffl_like.hub.protocol.wire import Frames, frames_of
from xffl_like.hub.server.federation import HubFederation
from xffl_like.hub.server.rounds import Arrival, Part, Round, RoundState, StateError


def _join(fed: HubFederation, name: str) -> str:
    session = f"session-{name}"
    fed.join(name, JoinRequest.from_json({"spec": SPEC, "session": session, "geometry": GEOMETRY, "every": 2,
                                          "steps": 20}))  # fmt: skip
    return session


def _arrive(fed: HubFederation, name: str, **msg):
    return fed.arrive(name, ArriveRequest.from_json(msg)).to_json()


def _created(session: str, theta: torch.Tensor) -> Frames:
    """The frames of a ``create`` upload of ``theta``, as the hub receives them."""
    return Frames(frames_of(UploadHeader(session, "create").to_json(), theta), 4 * theta.numel(), UploadHeader)


def test_a_stale_member_with_no_round_open_heals_at_once(tmp_path):
    """A member behind the hub's version arriving when no round is open opens none (it would wait up to
    grace_s for members that are not at a boundary) and reads θ_global at once."""
    fed = HubFederation(tmp_path / "state", None, log=lambda _: None)
    try:
        a = _join(fed, "a")
        theta = torch.arange(6, dtype=torch.float32)
        fed.create("a", _created(a, theta))
        b = _join(fed, "b")
        start = time.monotonic()
        out = _arrive(fed, "b", session=b, version=3, step=2, taken=2, tokens=32.0)
        assert out == {"action": "heal", "round": None, "reason": "version 3 (the hub's is 0)"}
        assert fed.round is None, "a heal opened a round the live members would have to fill"
        frames = Frames(fed.result("b", ResultRequest(b, out["round"]), lambda: True), 24, ResultHeader)
        received = frames.into(torch.empty(6, dtype=torch.float32))
        assert time.monotonic() - start < 30  # not grace_s (60 s): a wait load cannot fake
        assert frames.header.status == "healed" and torch.equal(received, theta)
        # A member at the hub's version still opens the round, and a stale one then joins it to heal.
        opened = _arrive(fed, "a", session=a, version=0, step=2, taken=2, tokens=32.0)
        assert opened["action"] == "upload" and opened["round"] == 0
        joined = _arrive(fed, "b", session=b, version=3, step=4, taken=2, tokens=32.0)
        assert joined == {"action": "heal", "round": 0, "reason": "version 3 (the hub's is 0)"}
    finally:
        fed.close()


def _link(fed: HubFederation, name: str) -> HubLink:
    """Facility ``name``'s link, its calls answered by ``fed`` in this process."""
    cfg = SimpleNamespace(hub="hub.example:29510", cert=None, ca=None, key=None, timeout_s=5.0)
    link = HubLink(cfg, name, SPEC, GEOMETRY, steps=20, every=2)
    link.channel.close()
    link.unary = lambda method, timeout=None, **kw: getattr(fed, method.lower())(
        name, CALLS[method][0].from_json(link._msg(**kw))
    )
    return link


def test_joining_a_federation_that_ended_is_refused_in_one_line(tmp_path):
    fed = HubFederation(tmp_path / "state", None, log=lambda _: None)
    try:
        a = _link(fed, "a")
        a.probe()  # a live federation admits
        fed.join("a", JoinRequest.from_json(a._msg(spec=SPEC, geometry=GEOMETRY, steps=20, every=2)))
        fed.create("a", _created(a.session, torch.zeros(6)))
        _link(fed, "b").probe()
        fed.snap.ended = True  # a's round at its step 20 ended it
        with pytest.raises(ElasticError) as refused:
            _link(fed, "b").probe()  # the launcher's check: before any worker starts
        line = str(refused.value)
        assert "\n" not in line and line.startswith("facility b: the federation at the hub hub.example:29510 has ended")
        assert "serve a new federation" in line
        with pytest.raises(ElasticError, match="has ended"):  # ended between the probe and the workers' join
            _link(fed, "c")._join(tmp_path / "mine", tmp_path / "theta", 0, 1)
    finally:
        fed.close()


def test_one_retry_policy_backs_off_with_full_jitter():
    """Every loop that asks the hub again waits a delay drawn in [0, min(cap, base x 2^attempt)]: growing,
    capped, and different each time (facilities that lost the hub together do not dial it again in step)."""
    policy = RetryPolicy(base=1.0, cap=30.0, rng=random.Random(0))
    assert [policy.bound(a) for a in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    delays = [policy.delay(5) for _ in range(200)]
    assert all(0 <= d <= 30 for d in delays) and len(set(delays)) == 200 and min(delays) < 10 < max(delays)
    slept, answers = [], iter([1, 2, 3, 7, 8])
    assert policy.poll(lambda: next(answers), lambda x: x > 5, slept.append) == 7
    assert len(slept) == 3 and all(0 <= s <= policy.bound(i) for i, s in enumerate(slept))


def test_a_round_moves_only_along_its_transitions():
    r = Round(0, 0, 0.0)
    with pytest.raises(StateError, match="open cannot become decided"):
        r.move(RoundState.DECIDED)
    for state in (RoundState.CLOSED, RoundState.COMMITTING, RoundState.DECIDED):
        r.move(state)
    a = Arrival(2, 2, 32.0, Part.HEAL)
    with pytest.raises(StateError, match="heal cannot become uploading"):
        a.move(Part.UPLOADING)
