"""``federation.delay=1`` through the hub (issue 37 item 5, ``delay_rule=own_full``): two facilities as independent
jobs at a real hub, each round's exchange in the leader's thread while the next round trains, landing at the next
boundary.

Every value is recomputed here from what the leaders dump (``tests/plugins/hook_round_dump.py``): per round its
upload ``before`` and θ_global ``after``, per landing its gathered parameters ``x``. By hand: the hub's θ_global of
version v is θ_{v-1} - lr x the weighted mean of θ_{v-1} - u_f; a facility's upload at the boundary where version v
landed is θ_v - (u_v - x), bitwise; the last round is made in the foreground, and both exports are the hub's final
θ_global, bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.hub import Facility, Hub
from test_hub import _export, _values

pytestmark = [pytest.mark.multiprocess, pytest.mark.cli]

STEPS, EVERY, LR = 12, 4, 0.8
DELAY = ["federation.delay=1", "federation.delay_rule=own_full", "federation.weights=tokens",
         "federation.outer.name=average", f"federation.outer.lr={LR}", "federation.elastic.min_facilities=2",
         "federation.elastic.grace_s=120", f"train.steps={STEPS}", f"federation.every={EVERY}", "optim.warmup_steps=2",
         "export.hf=true"]  # fmt: skip


def _dumps(dump: Path, name: str, kind: str) -> list[dict]:
    return [torch.load(p) for p in sorted((dump / name).glob(f"{kind}-*.pt"))]


def test_delayed_rounds_through_the_hub_own_full_by_hand(tmp_path):
    hub = Hub(tmp_path)
    a = Facility("a", hub, tmp_path, nproc=2, extra=DELAY)
    b = Facility("b", hub, tmp_path, nproc=1, extra=DELAY)
    try:
        (rc_a, out_a), (rc_b, out_b) = a.wait(), b.wait()
    finally:
        for f in (a, b):
            f.kill()
        hub.stop()
    assert rc_a == 0 and rc_b == 0, out_a + out_b
    dump = tmp_path / "dump"
    rounds = {n: {r["round"]: r for r in _dumps(dump, n, "round")} for n in "ab"}
    landings = {n: [d["x"] for d in _dumps(dump, n, "landing")] for n in "ab"}
    start = {n: next(r for r in rounds[n].values() if r["status"] in ("created", "joined")) for n in "ab"}
    theta = start["a"]["after"]
    assert torch.equal(start["b"]["after"], theta)
    versions = sorted(v for v, r in rounds["a"].items() if r["status"] == "accepted")
    assert versions == [1, 2, 3] == sorted(v for v, r in rounds["b"].items() if r["status"] == "accepted")
    for n in "ab":  # rounds at steps 4, 8 (in flight while the next round trained) and 12 (the last, foreground)
        assert [rounds[n][v]["step"] for v in versions] == [4, 8, 12]
        assert len(landings[n]) == 2, f"{n} landed {len(landings[n])} rounds, not those of steps 4 and 8"
    for v in versions:
        weights = rounds["a"][v]["weights"]
        assert weights == rounds["b"][v]["weights"] and set(weights) == {"a", "b"}
        total = sum(weights.values())
        mean = sum((theta.double() - rounds[n][v]["before"].double()) * (weights[n] / total) for n in "ab")
        expected = (theta.double() - LR * mean).float()
        after = rounds["a"][v]["after"]
        torch.testing.assert_close(after, expected, rtol=0, atol=1e-6, msg=f"version {v}")
        assert torch.equal(after, rounds["b"][v]["after"]), f"the copies of version {v} differ"
        if v < versions[-1]:  # version v landed at the next boundary: the upload there is θ_v - (u_v - x)
            for n in "ab":
                x = landings[n][v - 1]
                upload = after - (rounds[n][v]["before"] - x)
                assert torch.equal(rounds[n][v + 1]["before"], upload), f"{n}'s upload after version {v} landed"
                assert not torch.equal(x, rounds[n][v]["before"]), f"{n} did not train while version {v} was made"
        theta = after
    for f in (a, b):  # each landed round is recorded where it landed; the last boundary lands two
        records = f.summary()["round_records"]
        assert [r.get("landed") for r in records] == [[4], [8], None], records
    exports = {f.name: _export(f) for f in (a, b)}
    assert all(torch.equal(exports["a"][k], exports["b"][k]) for k in exports["a"])
    assert torch.equal(_values(exports["a"].values()), _values([theta])), "the exports are not the final θ_global"
