"""``federation.delay=1`` through the hub (issue 37 item 5): two facilities (2 processes FSDP and 1) as independent
jobs at a real hub, each round's exchange in the leader's thread while the next round trains, landing at the next
boundary; both rules (docs/running.md).

Every value is recomputed here from what the leaders dump (``tests/plugins/hook_round_dump.py``): per round its
upload ``before`` and θ_global ``after``, per boundary where the rule ran its gathered parameters ``x``. The last
round is made in the foreground, and both exports are the hub's final θ_global, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hub import Facility, Hub, run_to_end
from helpers.hub import dumped as _dumped
from helpers.hub import export_of as _export
from helpers.hub import newest_state as _newest_state
from helpers.hub import output as _text
from helpers.hub import value_bits as _values
from helpers.hub import wait_alive as _wait_for
from helpers.sparseloco_reference import topk_overrides

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli, pytest.mark.slow]

STEPS, EVERY, LR = 6, 2, 0.8  # three rounds: at steps 2, 4 and 6
COMMON = ["federation.delay=1", "federation.elastic.min_facilities=2", "federation.elastic.grace_s=120",
          f"train.steps={STEPS}", f"federation.every={EVERY}", "optim.warmup_steps=2", "export.hf=true"]  # fmt: skip
DELAY = [*COMMON, "federation.delay_rule=own_full", "federation.weights=tokens", "federation.outer.name=average",
         f"federation.outer.lr={LR}"]  # fmt: skip
NESTEROV_LR, MOMENTUM = 0.7, 0.9
EAGER = [*COMMON, "federation.outer.name=nesterov", f"federation.outer.lr={NESTEROV_LR}",
         f"federation.outer.momentum={MOMENTUM}"]  # fmt: skip


def _dumps(dump: Path, name: str, kind: str) -> list[dict]:
    return [torch.load(p) for p in sorted((dump / name).glob(f"{kind}-*.pt"))]


def _run(tmp_path, extra: list[str]) -> tuple[dict, dict, dict, list[Facility]]:
    """a and b run to their end; per facility its rounds by version and each boundary's rule's dump (``x``, eager's
    ``own``: θ_f); the
    federation's θ_0, both having started from it; the facilities."""
    hub = Hub(tmp_path)
    a = Facility("a", hub, tmp_path, nproc=2, extra=extra)
    b = Facility("b", hub, tmp_path, nproc=1, extra=extra)
    try:
        run_to_end(a, b)
    finally:
        hub.stop()
    dump = tmp_path / "dump"
    rounds = {n: {r["round"]: r for r in _dumps(dump, n, "round")} for n in "ab"}
    landings = {n: _dumps(dump, n, "landing") for n in "ab"}
    start = {n: next(r for r in rounds[n].values() if r["status"] in ("created", "joined")) for n in "ab"}
    assert torch.equal(start["b"]["after"], start["a"]["after"])
    for n in "ab":  # rounds at steps 2, 4 (in flight while the next round trained) and 6 (the last, foreground)
        versions = sorted(v for v, r in rounds[n].items() if r["status"] == "accepted")
        assert versions == [1, 2, 3] and [rounds[n][v]["step"] for v in versions] == [2, 4, 6], rounds[n]
    for f in (a, b):  # each landed round is recorded where it landed; the last boundary lands two
        records = f.summary()["round_records"]
        assert [r.get("landed") for r in records] == [[2], [4], None], records
    return rounds, landings, start["a"]["after"], [a, b]


def _exports_are(facilities: list[Facility], theta: torch.Tensor) -> None:
    exports = {f.name: _export(f) for f in facilities}
    assert all(torch.equal(exports["a"][k], exports["b"][k]) for k in exports["a"])
    assert torch.equal(_values(exports["a"].values()), _values([theta])), "the exports are not the final θ_global"


def test_delayed_rounds_through_the_hub_own_full_topk_by_hand(tmp_path):
    """own_full with top-k (error feedback): each facility applies the relayed round itself, bitwise as the hub (the
    copies are compared); a facility's upload at the boundary where version v landed is θ_v - (u_v - x), bitwise.
    (Uncompressed, the versions by hand too: :func:`test_delayed_rounds_through_the_hub_own_full_by_hand`.)"""
    topk = ["federation.compression=topk", "federation.error_feedback=true"]
    rounds, landings, theta, facilities = _run(tmp_path, [*DELAY, *topk])
    for n in "ab":
        assert len(landings[n]) == 2, f"{n} landed {len(landings[n])} rounds, not those of steps 2 and 4"
    for v in (1, 2, 3):
        weights = rounds["a"][v]["weights"]
        assert weights == rounds["b"][v]["weights"] and set(weights) == {"a", "b"}
        after = rounds["a"][v]["after"]
        assert torch.equal(after, rounds["b"][v]["after"]), f"the copies of version {v} differ"
        if v < 3:  # version v landed at the next boundary: the upload there is θ_v - (u_v - x)
            for n in "ab":
                x = landings[n][v - 1]["x"]
                upload = after - (rounds[n][v]["before"] - x)
                assert torch.equal(rounds[n][v + 1]["before"], upload), f"{n}'s upload after version {v} landed"
                assert not torch.equal(x, rounds[n][v]["before"]), f"{n} did not train while version {v} was made"
        theta = after
    _exports_are(facilities, theta)


def _nesterov(theta: torch.Tensor, buf: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """By hand: buf <- m buf + g; θ <- θ - lr (g + m buf) (float64)."""
    buf = MOMENTUM * buf + g
    return theta - NESTEROV_LR * (g + MOMENTUM * buf), buf


#: eager with top-k (error feedback, SparseLoCo's decay) through the hub: the codec's settings, the reference's too.
TOPK = {"density": 0.0625, "tile": 16, "bits": 4, "decay": 0.9}  # 16 of each 16 x 16 tile, 16 bins


def _topk_rounds_by_hand(rounds: dict, hub: list[torch.Tensor], landings: dict) -> dict[str, torch.Tensor]:
    """A compressed eager federation's versions from the dumped uploads and θ_f, with the numpy reference codec.
    Versions 1 and 2: each facility's message is the reference encoding of ``decay x residual + θ_{v-1} - u``
    (``ef = θ_{v-1} + residual``, as the facility keeps it), bitwise, and θ_v is θ_{v-1} minus, per index, the mean
    of the decoded messages over the facilities that sent it (fp32, fold order; the carrier: average at lr 1),
    bitwise at both facilities. Version 3, the
    final round, carries fp32 parameters: its θ_global is the weighted sum of the uploads in fold order, bitwise,
    and each facility's last message (kept, not sent) is the reference encoding of ``Δ + decay x residual`` (``Δ =
    θ_f - x`` at the last boundary), bitwise. Each facility's last message decoded, ``Δ̂``."""
    from helpers import model_shapes
    from helpers.sparseloco_reference import ref_decode, ref_encode

    t = TOPK
    codec = (model_shapes(), t["density"], t["tile"], t["bits"])
    residual = {n: torch.zeros_like(hub[0]) for n in "ab"}
    last = {}
    for v in (1, 2, 3):
        scales = rounds["a"][v]["weights"]  # each one's share, as the hub folded with it
        assert scales == rounds["b"][v]["weights"] and sorted(scales) == ["a", "b"], scales
        mean, count = torch.zeros_like(hub[0]), torch.zeros_like(hub[0])
        for n in sorted(scales):  # the hub's fold order
            r, ef = rounds[n][v], hub[v - 1] + residual[n]
            if v == 3:  # the final round: fp32 parameters, their weighted sum (average at lr 1: the mean itself)
                own, x = landings[n][2]["own"], landings[n][2]["x"]
                update = torch.sub(own, x).add(torch.sub(ef, hub[2]).mul_(t["decay"]))
                assert r["message"] == ref_encode(update.numpy(), *codec), f"{n}'s last message"
                last[n] = torch.from_numpy(ref_decode(r["message"], *codec)[0])
                mean.add_(r["before"], alpha=scales[n])
                continue
            update = (ef - r["before"]).sub_(ef - hub[v - 1], alpha=1.0 - t["decay"])
            assert r["message"] == ref_encode(update.numpy(), *codec), f"{n}'s message at version {v}"
            values, mask = ref_decode(r["message"], *codec)
            sent = torch.from_numpy(values)
            residual[n] = update - sent
            mean.add_(sent)  # equal weights: each counts 1 (the relay's fold)
            count.add_(torch.from_numpy(mask).float())
        assert v == 3 or (count == 1).any() and (count == 2).any()  # each sent what the other did not, and shared
        expected = mean if v == 3 else hub[v - 1] - mean.div_(torch.where(count > 0, count, 1.0))
        assert torch.equal(hub[v], expected), f"version {v} is not the weighted sum recomputed here"
    return last


@pytest.mark.parametrize("compression", ["none", "topk"])
def test_delayed_rounds_through_the_hub_eager_by_hand(tmp_path, compression):
    """eager (the default rule): each facility's θ_f and Nesterov state recomputed here. The hub sums the means
    (θ_v = θ_{v-1} - mean of θ_{v-1} - u_f); at each boundary D = θ_{v-1} - θ_v of the landed round, Δ = θ_f - x,
    θ_f <- nesterov(θ_f, D - s' Δ_prev + s Δ) (s = 1/2: two facilities, uniform), u = θ_v - Δ; at the last,
    u = nesterov(θ_f, D - s' Δ_prev) - lr (1 + m) Δ, so that the final θ_global is one world's eager end,
    Σ_f s_f nesterov_f(θ_f, D - s' Δ_prev + D_3), D_3 = Σ_f s_f Δ_f the last round's mean.

    With top-k (error feedback, decay) the means are the decoded messages' (each message and θ_v recomputed with the
    reference codec, bitwise: :func:`_topk_rounds_by_hand`), the stale own share taken out is ``s' Δ`` (not its
    message), and the final round carries fp32 parameters: u = nesterov(θ_f, D - s' Δ_prev) - lr (1 + m) Δ̂, Δ̂ the
    facility's last message (``Δ + decay x residual``, encoded, kept, not sent) decoded, so that the end is one
    world's, with D_3 the mean of the decoded last messages."""
    topk = compression == "topk"
    codec = topk_overrides(TOPK["density"], TOPK["bits"], TOPK["decay"], TOPK["tile"]) if topk else []
    rounds, landings, theta0, facilities = _run(tmp_path, [*EAGER, *codec])
    atol = 2e-6
    hub = [theta0] + [rounds["a"][v]["after"] for v in (1, 2, 3)]
    for v in (1, 2, 3):
        assert torch.equal(rounds["a"][v]["after"], rounds["b"][v]["after"]), f"the copies of version {v} differ"
    last_messages = _topk_rounds_by_hand(rounds, hub, landings) if topk else {}
    hub = [h.double() for h in hub]
    for v in (1, 2, 3) if not topk else ():  # the hub: a sum of the means (top-k: of the messages', above)
        mean = sum(hub[v - 1] - rounds[n][v]["before"].double() for n in "ab") / 2
        torch.testing.assert_close(hub[v], hub[v - 1] - mean, rtol=0, atol=atol, msg=f"version {v}")
    last = {}  # per facility at the last boundary: θ_f, its momentum, the others' part, its last Δ (top-k: Δ̂)
    for n in "ab":
        assert len(landings[n]) == 3, f"{n}'s rule ran {len(landings[n])} times, not at steps 2, 4 and 6"
        own, buf, before = theta0.double(), torch.zeros_like(hub[0]), torch.zeros_like(hub[0])
        for k in (1, 2, 3):  # the boundary at step 2k: version k - 1 landed (none at the first)
            if landings[n][k - 1]["own"] is not None:  # θ_f as the facility held it
                torch.testing.assert_close(landings[n][k - 1]["own"].double(), own, rtol=0, atol=atol)
            delta = own - landings[n][k - 1]["x"].double()
            others = hub[k - 2] - hub[k - 1] - 0.5 * before if k > 1 else torch.zeros_like(own)
            if k < 3:
                own, buf = _nesterov(own, buf, others + 0.5 * delta)
                upload = hub[k - 1] - delta
            else:
                ended, _ = _nesterov(own, buf, others)
                sent = last_messages[n].double() if topk else delta
                upload = ended - NESTEROV_LR * (1 + MOMENTUM) * sent
                last[n] = (own, buf, others, sent)
            torch.testing.assert_close(rounds[n][k]["before"].double(), upload, rtol=0, atol=atol, msg=f"{n}, {k}")
            before = delta
        assert not torch.equal(rounds["a"][1]["before"], rounds["b"][1]["before"])
    last_mean = sum(last[n][3] for n in "ab") / 2  # D_3, which replaces the fresh share in one world
    one_world_end = sum(_nesterov(own, buf, others + last_mean)[0] for own, buf, others, _ in last.values()) / 2
    torch.testing.assert_close(hub[3], one_world_end, rtol=0, atol=atol, msg="the end is not one world's")
    _exports_are(facilities, rounds["a"][3]["after"])


def test_delayed_rounds_through_a_hub_killed_mid_run_end_on_its_final_theta(tmp_path):
    """eager, 6 steps, rounds every 2. Both facilities hold before sending the round at step 4 (in flight behind
    steps 5-6) until the hub is SIGKILLed; that round is missed and lands nothing at step 6, the last, whose
    final round waits for the hub to come back on its --state (and, the federation being behind, realigns them back).
    Whatever each facility then met (a round missed, healed, realigned), both end at their last step on the
    federation's final version: no accepted round merged contributions of another step, and both exports are the
    hub's final θ_global, bit for bit."""
    hub = Hub(tmp_path)
    go = tmp_path / "go"
    extra = [*EAGER, "federation.elastic.final_wait_s=200", "federation.elastic.grace_s=30"]
    facilities = [Facility(n, hub, tmp_path, extra=extra, env={"XFFL_TEST_ELASTIC_HOLD": f"1:{go}"}) for n in "ab"]
    try:
        _wait_for(lambda: all(_dumped(f, 1) for f in facilities), what="version 1 at a and b", alive=facilities)
        hub.kill()
        go.touch()
        _wait_for(lambda: all("round at step 4 missed" in _text(f) for f in facilities), 120, "the missed round",
                  alive=facilities)  # fmt: skip
        hub.start()
        for f in facilities:
            rc, out = f.wait()
            assert rc == 0, out[-4000:]
    finally:
        for f in facilities:
            f.kill()
        hub.stop()
    meta, final = _newest_state(hub)
    assert meta["ended"] and meta["progress"] == STEPS // EVERY, meta
    for f in facilities:
        for r in [torch.load(p) for p in (f.dump / f.name).glob("round-*.pt")]:
            assert r["status"] != "accepted" or r["step"] == EVERY * r["round"], (f.name, r["round"], r["step"])
    _exports_are(facilities, final["theta"])


def _step_of_latest(f: Facility) -> int | None:
    """The step of the facility's newest published checkpoint (None: none yet)."""
    from xffl_like.checkpoint.store import latest_checkpoint

    path = latest_checkpoint(f.dir / "checkpoints")
    return None if path is None else int(path.name.removeprefix("step-"))


def _restart(tmp_path, hub: Hub, b: Facility, extra: list[str], env=None) -> Facility:
    """b SIGKILLed, and started again at once, resumed from its newest checkpoint: its launcher waits for the killed
    process's heartbeat to lapse at the hub before joining (a restart within the liveness window)."""
    b.kill()
    return Facility("b", hub, tmp_path, nproc=2, extra=extra, env=env, resume=str(tmp_path / "run-b"))


@pytest.fixture(scope="module")
def pending(tmp_path_factory) -> tuple[dict, dict, list[torch.Tensor], list[Facility]]:
    """The federation of :func:`test_a_facility_killed_with_its_delayed_round_pending_sends_it_once` (own_full, 8
    steps, b of two FSDP processes killed twice with a round pending, a of one never stopped), run once for it and
    :func:`test_delayed_rounds_through_the_hub_own_full_by_hand`: per facility its dumped rounds in order and its
    landings, θ_global of versions 0-4 (a's copies), and the facilities (a, b's last job)."""
    tmp_path = tmp_path_factory.mktemp("pending")
    extra = [o for o in DELAY if not o.startswith("train.steps=")] + ["train.steps=8"]
    hub = Hub(tmp_path)
    go, paused, never = (tmp_path / n for n in ("go-1", "paused", "never"))
    go3 = tmp_path / "go-3"
    a = Facility("a", hub, tmp_path, extra=extra, env={"XFFL_TEST_ELASTIC_HOLD": f"1:{go},3:{go3}"})
    b = Facility("b", hub, tmp_path, nproc=2, extra=extra, env={"XFFL_TEST_ELASTIC_HOLD": f"1:{never}"})
    running = [a, b]
    try:
        _wait_for(lambda: _step_of_latest(b) == 4, what="b's checkpoint at step 4", alive=running)
        b = _restart(tmp_path, hub, b, extra, env={"XFFL_TEST_ELASTIC_PAUSE": f"2:{paused}"})
        running = [a, b]
        _wait_for(lambda: "is open" in _text(b), what="b's round at step 4 open", alive=running)
        go.touch()
        # its upload at step 6 is at the hub, and its checkpoint at step 6 (async: written while the round goes up)
        _wait_for(lambda: paused.exists() and _step_of_latest(b) == 6, what="b's upload at step 6", alive=running)
        b = _restart(tmp_path, hub, b, extra)
        running = [a, b]
        _wait_for(lambda: "counted it" in _text(b), what="b's round at step 6 counted", alive=running)
        go3.touch()
        run_to_end(a, b)
    finally:
        for f in running:
            f.kill()
        hub.stop()
    dump = tmp_path / "dump"
    rounds = {n: _dumps(dump, n, "round") for n in "ab"}
    landings = {n: _dumps(dump, n, "landing") for n in "ab"}
    theta = [next(r for n in "ab" for r in rounds[n] if r["status"] == "created")["after"]]
    theta += [r["after"] for v in (1, 2, 3, 4) for r in rounds["a"] if r["round"] == v and r["status"] == "accepted"]
    return rounds, landings, theta, [a, b]


def test_a_facility_killed_with_its_delayed_round_pending_sends_it_once(pending):
    """own_full, 8 steps, rounds every 2 (versions 1-4 at steps 2, 4, 6 and 8, the last in the foreground); b of two
    FSDP processes, a of one. b is SIGKILLed twice after a boundary's checkpoint, with that boundary's round not yet
    landed, and resumed from it:

    - open: b holds before sending its round at step 4 (version 1), a before arriving at it; b is killed and
      resumed from step 4: the hub answers that round is open, and b sends its checkpointed upload;
    - counted: b uploads its round at step 6 and is killed before it lands; a arrives, version 3 counts b's upload;
      b, resumed from step 6, hears it was counted, sends nothing, and lands version 3 at step 8 by the rule.

    By hand from the dumps: every version is θ_{v-1} - lr x the tokens-weighted mean over a and b (both in every
    round, b at twice a's weight, its two ranks' tokens: the resent round claims its own); b's uploads follow the
    rule across both resumes, u_{v+1} = θ_v - (u_v - x) with ``x`` its model where version v landed, and the upload a
    checkpoint kept is that (the one sent after the first resume, the one the second resume holds). A pending round
    dropped leaves b out of version 2 or its rule off; one counted twice (sent again, or folded into the next upload)
    puts b's uploads off the rule."""
    rounds, landings, theta, facilities = pending
    version = {n: {r["round"]: r for r in rounds[n] if r["status"] == "accepted"} for n in "ab"}
    assert sorted(version["a"]) == [1, 2, 3, 4] and sorted(version["b"]) == [1, 2, 4], {
        n: [(r["round"], r["status"]) for r in rounds[n]] for n in "ab"
    }
    resumed = [r for r in rounds["b"] if r["status"] == "resumed" or (r["status"] == "joined" and r["round"] > 0)]
    assert [(r["round"], r["status"]) for r in resumed] == [(1, "resumed"), (3, "joined")], resumed
    x = [landing["x"] for landing in landings["b"]]  # where versions 1, 2 and 3 landed
    assert len(x) == 3, f"b's rule ran {len(x)} times, not at steps 4, 6 and 8"
    assert len(theta) == 5, "a holds one accepted copy of each of versions 1-4"
    upload_b = {1: version["b"][1]["before"]}
    for v in (1, 2, 3):  # b's upload after version v landed: the rule, across both resumes
        upload_b[v + 1] = theta[v] - (upload_b[v] - x[v - 1])
    assert torch.equal(resumed[0]["before"], upload_b[2]), "the upload b's checkpoint kept at step 4"
    assert torch.equal(version["b"][2]["before"], upload_b[2]), "b's resent upload at step 4"
    assert torch.equal(resumed[1]["before"], upload_b[3]), "the upload b's checkpoint kept at step 6"
    assert torch.equal(version["b"][4]["before"], upload_b[4]), "b's last upload: version 3 landed once"
    for v in (1, 2, 3, 4):
        weights = version["a"][v]["weights"]
        assert set(weights) == {"a", "b"} and weights["b"] == 2 * weights["a"], (v, weights)  # b: 2 ranks' tokens
        ups = {"a": version["a"][v]["before"], "b": upload_b[v]}
        mean = sum((theta[v - 1].double() - ups[n].double()) * weights[n] for n in "ab")
        expected = (theta[v - 1].double() - LR * mean).float()
        torch.testing.assert_close(theta[v], expected, rtol=0, atol=1e-6, msg=f"version {v}")
    assert torch.equal(version["b"][4]["after"], theta[4])
    _exports_are(facilities, theta[4])


def test_delayed_rounds_through_the_hub_own_full_by_hand(pending):
    """own_full, uncompressed, on the federation of the pending test (a never stopped, b killed twice and resumed):
    the hub's θ_global of version v is θ_{v-1} - lr x the tokens-weighted mean of θ_{v-1} - u_f (fp32) over the
    uploads the facilities dumped (b's of version 3: the one its checkpoint kept, its resumed job's); every copy
    either facility holds is a's, bitwise; a's upload at the boundary where version v landed is θ_v - (u_v - x),
    bitwise, ``x`` its model there (it trained while version v was made), and each landed round is recorded where it
    landed. (b's uploads by the rule across its resumes: the pending test.)"""
    rounds, landings, theta, facilities = pending
    start = {n: next(r for r in rounds[n] if r["status"] in ("created", "joined")) for n in "ab"}
    assert start["a"]["round"] == start["b"]["round"] == 0 and torch.equal(start["a"]["after"], start["b"]["after"])
    a = {r["round"]: r for r in rounds["a"] if r["status"] == "accepted"}
    assert sorted(a) == [1, 2, 3, 4] and [a[v]["step"] for v in (1, 2, 3, 4)] == [2, 4, 6, 8], rounds["a"]
    for r in rounds["b"]:  # b's copies (its accepted rounds, its resumed job's and its rejoined job's θ_global)
        if r["round"] > 0:
            assert torch.equal(r["after"], theta[r["round"]]), f"b's copy of version {r['round']} ({r['status']})"
    b = {r["round"]: r for r in rounds["b"] if r["round"] > 0 and r["status"] in ("accepted", "joined")}
    assert sorted(b) == [1, 2, 3, 4] and b[3]["status"] == "joined", [(r["round"], r["status"]) for r in rounds["b"]]
    for v in (1, 2, 3, 4):
        weights = a[v]["weights"]
        assert set(weights) == {"a", "b"} and (b[v]["status"] == "joined" or b[v]["weights"] == weights), (v, weights)
        assert b[v]["status"] == "joined" or b[v]["step"] == 2 * v, b[v]
        total = sum(weights.values())
        ups = {"a": a[v]["before"], "b": b[v]["before"]}
        mean = sum((theta[v - 1].double() - ups[n].double()) * (weights[n] / total) for n in "ab")
        torch.testing.assert_close(theta[v], (theta[v - 1].double() - LR * mean).float(), rtol=0, atol=1e-6,
                                   msg=f"version {v}")  # fmt: skip
    assert len(landings["a"]) == 3, f"a landed {len(landings['a'])} rounds, not those of steps 2, 4 and 6"
    for v in (1, 2, 3):  # version v landed at the next boundary: a's upload there is θ_v - (u_v - x)
        x = landings["a"][v - 1]["x"]
        assert torch.equal(a[v + 1]["before"], theta[v] - (a[v]["before"] - x)), f"a's upload after version {v} landed"
        assert not torch.equal(x, a[v]["before"]), f"a did not train while version {v} was made"
    records = facilities[0].summary()["round_records"]
    assert [r.get("landed") for r in records] == [[2], [4], [6], None], records
    _exports_are(facilities, theta[4])
