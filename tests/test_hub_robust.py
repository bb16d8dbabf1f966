"""Issue 38 item 4: norm checks that hold with two members and cannot be switched off or primed, and robust
aggregation (``federation.elastic.aggregate=mean|median|trimmed_mean``) computed a window at a time over the
spooled uploads. In one process: a real gRPC server on a free loopback port (``--insecure``, the request
names its facility) over a fresh :class:`HubFederation`, the dishonest member a raw gRPC client speaking the
wire format; the rules' arithmetic checked against numpy over the same uploads."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch
from helpers.hub import serve

from xffl_like.bench.hub_drift import Federation, drift, spec_of
from xffl_like.hub.protocol.wire import GRPC_OPTIONS, SERVICE, frames_of, pack, unpack
from xffl_like.hub.server import federation as hub_federation
from xffl_like.hub.server.federation import HubFederation

GEOMETRY = {"batch_size": 2, "seq_len": 8, "dp": 1}
N = 1000


class Raw:
    """One member as a raw gRPC client: JSON control messages and raw frames, no :class:`HubLink`."""

    def __init__(self, channel: grpc.Channel, name: str):
        self.ch, self.name, self.session = channel, name, f"s-{name}"

    def call(self, method: str, **msg) -> dict:
        body = pack({"session": self.session, "facility": self.name, **msg})
        return unpack(self.ch.unary_unary(f"/{SERVICE}/{method}")(body, timeout=30))

    def join(self, spec: dict) -> dict:
        return self.call("Join", spec=spec, geometry=GEOMETRY, every=2, steps=2000)  # the spec's 1000 rounds

    def upload(self, kind: str, values: torch.Tensor, rid: int | None = None) -> dict:
        header = {"session": self.session, "facility": self.name, "kind": kind, "round": rid}
        return unpack(self.ch.stream_unary(f"/{SERVICE}/Upload")(frames_of(header, values), timeout=30))

    def arrive(self, version: int, step: int) -> dict:
        return self.call("Arrive", version=version, step=step, taken=2, tokens=16.0)

    def result(self, rid: int) -> tuple[dict, torch.Tensor]:
        body = pack({"session": self.session, "facility": self.name, "round": rid})
        stream = iter(self.ch.unary_stream(f"/{SERVICE}/Result")(body, timeout=30))
        header = unpack(next(stream))
        return header, torch.frombuffer(bytearray(b"".join(stream)), dtype=torch.float32)


@pytest.fixture
def hub(tmp_path):
    """A hub over a fresh federation on a free loopback port; yields (federation, channel)."""
    fed = HubFederation(tmp_path / "state", None, log=lambda _: None)
    server, port = serve(fed)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    yield fed, channel
    channel.close()
    server.stop(grace=None)
    fed.close()


def _federation(hub, names: list[str], theta0: torch.Tensor, **spec) -> list[Raw]:
    fed, channel = hub
    members = [Raw(channel, n) for n in names]
    for m in members:
        m.join(spec_of(theta0.numel(), **spec))
        if m is members[0]:
            m.upload("create", theta0)
    return members


def _round(fed: HubFederation, uploads: dict[Raw, torch.Tensor]) -> dict:
    """Every member arrives and uploads its parameters; the round's outcome, as the first member reads it."""
    step, rid = 2 * (fed.version + 1), None
    for m in uploads:
        reply = m.arrive(fed.version, step)
        assert reply["action"] == "upload", reply
        rid = reply["round"]
    for m, values in uploads.items():
        assert m.upload("round", values, rid)["ok"]
    header, _ = next(iter(uploads)).result(rid)
    return header


def _theta0(seed=0) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)) * 10  # |θ| about 316


def _honest(theta: torch.Tensor, seed: int, norm: float = 1.0) -> torch.Tensor:
    d = torch.randn(theta.numel(), generator=torch.Generator().manual_seed(seed))
    return theta - d * (norm / d.norm())


# ------------------------------------------------------------------------------------------------ norm checks
def test_a_first_upload_of_1e30_is_refused_alone_and_beside_another(hub):
    """Before: a member's first upload was not checked (no history of its own, fewer than three in the round):
    θ_global + 1e30 became θ_global's mean. Now each is measured against the other, and every upload against
    max_norm_ratio x |θ_global|."""
    fed, _ = hub
    theta0 = _theta0()
    a, x = _federation(hub, ["a", "x"], theta0)
    out = _round(fed, {a: _honest(theta0, 1), x: theta0 + 1e30})
    assert out["status"] == "accepted" and "norm" in out["rejected"]["x"], out
    assert torch.equal(fed.theta, _honest(theta0, 1))
    a.call("Leave")
    assert "norm" in _round(fed, {x: fed.theta + 1e30})["rejected"]["x"]  # alone: the absolute bound
    assert torch.equal(fed.theta, _honest(theta0, 1))


def test_a_history_of_zero_updates_does_not_switch_the_check_off(hub):
    """Before: a member whose own accepted updates were zero had a reference of 0, and the check was skipped:
    its next update, however large, was accepted. Now the reference has a floor, and the other member's."""
    fed, _ = hub
    theta0 = _theta0()
    (x,) = _federation(hub, ["x"], theta0)
    for _ in range(3):
        assert _round(fed, {x: fed.theta.clone()})["status"] == "accepted"  # zero updates
    big = fed.theta - 50.0 * torch.ones(N) / math.sqrt(N)  # norm 50: under 10 x |θ|, over 10 x the floor
    out = _round(fed, {x: big})
    assert "norm" in out["rejected"].get("x", ""), out
    assert torch.equal(fed.theta, theta0)


def test_a_member_cannot_prime_its_own_reference(hub):
    """Before: with two members, a member's reference was its own history (none in its first two rounds, then
    the median of its own norms), so 9x the honest norm, then 81x, then 729x... were each accepted. Now the
    reference is the other member's norm and the federation's accepted ones: only the first passes."""
    fed, _ = hub
    theta0 = _theta0()
    a, x = _federation(hub, ["a", "x"], theta0)
    u = torch.ones(N) / math.sqrt(N)
    fates = []
    for k in range(1, 5):
        theta = fed.theta.clone()
        out = _round(fed, {a: _honest(theta, k), x: theta - 9.0**k * u})
        fates.append("x" in out["accepted"])
    assert fates == [True, False, False, False], fates
    assert float(torch.dot(theta0 - fed.theta, u)) < 9.0  # only the first push landed (halved by the mean)


# ------------------------------------------------------------------------------------------------ the rules
def _uploads(theta: torch.Tensor, members: int, seed: int) -> list[torch.Tensor]:
    return [_honest(theta, seed * 100 + i, norm=1.0 + 0.1 * i) for i in range(members)]


@pytest.mark.parametrize("rule, members, trim", [("median", 5, 0.2), ("median", 4, 0.2), ("trimmed_mean", 6, 0.2),
                                                 ("trimmed_mean", 5, 0.0), ("trimmed_mean", 3, 0.2)])  # fmt: skip
def test_median_and_trimmed_mean_match_numpy_over_the_same_uploads(tmp_path, monkeypatch, rule, members, trim):
    """θ_global after a round is the coordinate-wise rule over the members' parameters, read a window at a time
    (windows of 4096 values here: 10,000 values in three windows), as numpy computes it over the whole."""
    monkeypatch.setattr(hub_federation, "window", lambda uploads: 4096)  # the commit's windows
    numel = 10_000
    theta0 = torch.randn(numel, generator=torch.Generator().manual_seed(7))
    names = [f"m{i}" for i in range(members)]
    fed = Federation(tmp_path / "state", spec_of(numel, rule, "tokens", trim), names, theta0)
    try:
        ups = _uploads(theta0, members, 1)
        out = fed.round(dict(zip(names, ups)), {n: 4.0 * (i + 1) for i, n in enumerate(names)})
        assert sorted(out.accepted) == names
        stack = np.stack([u.numpy() for u in ups])
        if rule == "median":
            expected = np.median(stack, axis=0)
            assert np.array_equal(fed.theta.numpy(), expected.astype(np.float32))
        else:
            k = min(math.ceil(trim * members - 1e-9), (members - 1) // 2)  # cut from each end
            expected = np.sort(stack, axis=0)[k : members - k].astype(np.float64).mean(axis=0)
            np.testing.assert_allclose(fed.theta.numpy(), expected, rtol=2e-6, atol=1e-6)
        assert not list((tmp_path / "state" / "spool").iterdir())  # the spooled uploads are removed
    finally:
        fed.close()


def test_the_median_of_compressed_updates(tmp_path, monkeypatch):
    """With compression the spool holds encoded updates θ_global - θ_f: the rule runs over the decoded ones
    (read in windows that do not line up with the codec's pieces), and the outer step applies it."""
    monkeypatch.setattr(hub_federation, "window", lambda uploads: 4096)  # the commit's windows
    numel, names = 10_000, ["a", "b", "c"]
    theta0 = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    fed = Federation(tmp_path / "state", spec_of(numel, "median", compression="bf16"), names, theta0)
    try:
        updates = [theta0 - u for u in _uploads(theta0, 3, 2)]
        encoded = [u.to(torch.bfloat16).view(torch.uint8) for u in updates]
        fed.round(dict(zip(names, encoded)), dict.fromkeys(names, 8.0))
        decoded = np.stack([u.to(torch.bfloat16).float().numpy() for u in updates])
        np.testing.assert_allclose(fed.theta.numpy(), theta0.numpy() - np.median(decoded, axis=0), rtol=0, atol=1e-6)
    finally:
        fed.close()


def test_mean_is_the_default_and_unchanged(tmp_path):
    """A description without ``aggregate`` (a federation saved before the key) and ``aggregate=mean`` give the
    same θ_global, bit for bit: the token-weighted mean."""
    thetas = []
    for i, spec in enumerate([spec_of(N, "mean", "tokens"), {**spec_of(N, weights="tokens"), "aggregate": None}]):
        if spec["aggregate"] is None:
            del spec["aggregate"], spec["trim"]
        theta0 = _theta0()
        fed = Federation(tmp_path / f"state{i}", spec, ["a", "b", "c"], theta0)
        try:
            fed.round(dict(zip("abc", _uploads(theta0, 3, 5))), {"a": 4.0, "b": 8.0, "c": 32.0})
            thetas.append(fed.theta)
        finally:
            fed.close()
    ups = _uploads(_theta0(), 3, 5)
    assert torch.equal(thetas[0], thetas[1])
    torch.testing.assert_close(thetas[0], (4 * ups[0] + 8 * ups[1] + 32 * ups[2]) / 44)


def test_the_drift_attack_is_bounded_under_median_and_trimmed_mean():
    """Two honest members (random updates of norm 1) and one attacker pushing 9.5x that along one direction
    every round, accepted every round (under max_norm_ratio): under the mean θ_global drifts 9.5/3 per round
    (twice that under token weights); under the median or trimmed mean at most about one honest step."""
    rounds = 10
    for weights in ("uniform", "tokens"):
        assert drift("mean", weights, rounds=rounds)["drift"] > 3.0 * rounds
        for rule in ("median", "trimmed_mean"):
            r = drift(rule, weights, rounds=rounds)
            assert r["attacker_accepted"] == rounds, r
            assert r["drift"] < 1.0 * rounds, r  # the honest step is 1.0 per member and round


# ------------------------------------------------------------------------------------------------ the key
def test_a_facility_with_another_rule_is_refused_in_one_line(hub):
    fed, channel = hub
    _federation(hub, ["a"], _theta0(), aggregate="median")
    with pytest.raises(grpc.RpcError) as refused:
        Raw(channel, "b").join(spec_of(N, "mean"))
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    line = refused.value.details()
    assert "federation.elastic.aggregate: 'mean' here, 'median' in the federation" in line and "\n" not in line


def test_a_creator_with_an_unknown_rule_is_refused_in_one_line(hub):
    _, channel = hub
    for key, value in (("aggregate", "mode"), ("trim", 0.5)):
        with pytest.raises(grpc.RpcError) as refused:
            Raw(channel, "a").join({**spec_of(N), key: value})
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"federation.elastic.{key}={value!r}" in refused.value.details()


@pytest.mark.parametrize("override, words", [("federation.elastic.aggregate=mode", "federation.elastic.aggregate"),
                                             ("federation.elastic.trim=0.5", "federation.elastic.trim")])  # fmt: skip
def test_the_config_key_is_checked_before_workers_and_travels_in_the_description(override, words):
    from hydra import compose, initialize_config_dir

    from xffl_like.config.schema import job_config
    from xffl_like.config.validate import ConfigError, validate_config
    from xffl_like.hub.protocol.spec import hub_spec
    from xffl_like.job import CONF_DIR, choices, resolve

    base = ["+experiment=llama_fed", "logger=none", "train.steps=4", "optim.warmup_steps=2",
            "distributed.federated=null", "federation.elastic.hub=127.0.0.1:1"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        bad = compose(config_name="config", overrides=[*base, override])
        good = compose(config_name="config", overrides=[*base, "federation.elastic.aggregate=trimmed_mean"])
    with pytest.raises(ConfigError) as info:
        validate_config(resolve(bad), 4, 4, CONF_DIR.parent, choices(bad))
    assert words in str(info.value) and "\n" not in str(info.value)
    spec = hub_spec(job_config(resolve(good), choices(good)))
    assert (spec["aggregate"], spec["trim"]) == ("trimmed_mean", 0.2)


def test_a_federation_saved_before_the_key_takes_facilities_with_the_default():
    from xffl_like.hub.protocol.spec import first_difference

    old = spec_of(N)
    del old["aggregate"], old["trim"]
    assert first_difference(spec_of(N), old) is None
    assert first_difference(spec_of(N, "median"), old) == (
        "federation.elastic.aggregate: 'median' here, 'mean' in the federation"
    )
