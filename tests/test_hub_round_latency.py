"""Issue 37: a facility dialling with another compression or delay than the federation's is refused in one
line naming both values and the override that fixes it; the hub logs, per committed round, the time from the
end of its last upload to the first byte of its result. In one process: a real gRPC server on a free loopback
port over a fresh :class:`HubFederation` (the fixture of :mod:`test_hub_robust`), members as raw clients."""

from __future__ import annotations

import re
import time

import grpc
import pytest
import torch
from helpers.hub import serve
from test_hub_robust import N, Raw, hub  # noqa: F401 - hub: the fixture

from xffl_like.bench.hub_drift import spec_of
from xffl_like.hub.protocol.spec import SpecError, check_spec, first_difference
from xffl_like.hub.server.federation import HubFederation
from xffl_like.hub.server.latency import LINE

TOPK = {"kind": "topk", "chunk_size": 4096, "error_feedback": True, "density": 0.03125, "bits": 2, "decay": 0.95,
        "chunks": "tiles", "quantizer": "bins", "mean": "senders"}  # fmt: skip


@pytest.mark.parametrize(
    "mine, words",
    [
        ({"compression": TOPK}, "federation.compression: 'topk' here, 'none' in the federation"),
        ({"delay": 1}, "federation.delay: 1 here, 0 in the federation"),
    ],
)
def test_a_facility_with_another_compression_or_delay_is_refused_in_one_line(hub, mine, words):  # noqa: F811
    fed, channel = hub
    a, b = Raw(channel, "a"), Raw(channel, "b")
    a.join({**spec_of(N), "delay": 0})
    a.upload("create", torch.zeros(N))
    with pytest.raises(grpc.RpcError) as refused:
        b.join({**spec_of(N), "delay": 0, **mine})
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    line = refused.value.details()
    fix = "federation.compression=none" if "compression" in mine else "federation.delay=0"
    assert words in line and f"run this facility with {fix}" in line and "\n" not in line, line


def test_a_description_of_the_weighted_top_k_mean_is_refused_in_one_line():
    """A federation described before issue 39 (no ``chunks``/``quantizer``/``mean``: flat chunks, levels, the
    weighted mean, whose mean is no longer computed) is refused; flat chunks and levels with the mean over the
    senders are a description of today's; an unknown chunking or quantizer is refused."""
    check_spec({**spec_of(N), "compression": TOPK})
    check_spec({**spec_of(N), "compression": {**TOPK, "chunks": "flat", "quantizer": "levels"}})
    flat = {k: v for k, v in TOPK.items() if k not in ("chunks", "quantizer", "mean")}
    with pytest.raises(SpecError) as err:
        check_spec({**spec_of(N), "compression": flat})
    line = str(err.value)
    assert "the weighted top-k mean of before issue 39 is no longer computed" in line and "\n" not in line
    for key, bad in (("chunks", "rows"), ("quantizer", None)):
        with pytest.raises(SpecError, match=f"federation.topk.{key}={bad!r} is invalid"):
            check_spec({**spec_of(N), "compression": {**TOPK, key: bad}})


def test_the_first_compression_setting_that_differs_is_named_with_its_key():
    base = spec_of(N)
    theirs = {**base, "compression": TOPK}
    denser = {**base, "compression": {**TOPK, "density": 0.0625}}
    assert first_difference(denser, theirs).startswith(
        "federation.topk.density: 0.0625 here, 0.03125 in the federation: every facility of a federation must use the "
        "same;"
    )
    assert first_difference(denser, theirs).endswith("run this facility with federation.topk.density=0.03125")
    smaller = {**base, "compression": {**TOPK, "tile": 32}}
    assert first_difference(smaller, theirs).startswith("federation.topk.tile: 32 here, 64 in the federation")
    assert first_difference(smaller, theirs).endswith("run this facility with federation.topk.tile=64")
    flat = {**base, "compression": {**TOPK, "chunks": "flat"}}
    assert first_difference(flat, theirs).endswith("run this facility with federation.topk.chunks=tiles")
    levels = {**base, "compression": {**TOPK, "quantizer": "levels"}}
    assert first_difference(levels, theirs).startswith("federation.topk.quantizer: 'levels' here, 'bins' in the")
    no_ef = {**base, "compression": {**TOPK, "error_feedback": False}}
    assert first_difference(no_ef, theirs).endswith("federation.error_feedback=true")
    assert first_difference({**base, "delay": 0}, base) is None  # a federation saved before the key: delay 0
    assert "federation.delay: 1 here, 0" in first_difference({**base, "delay": 1}, base)
    eager = {**base, "delay": 1, "delay_rule": "eager", "outer": {**base["outer"], "lr": 1.0}}
    own_full = {**base, "delay": 1, "delay_rule": "own_full"}
    assert first_difference(own_full, eager).endswith(
        "federation.delay_rule: 'own_full' here, 'eager' in the federation: every facility of a federation must use "
        "the same; run this facility with federation.delay_rule=eager"
    )


def test_the_hub_logs_each_rounds_last_upload_to_its_first_result_byte(tmp_path, monkeypatch):
    """Two rounds of two members; the second member's upload is held back 0.3 s after the first's ends, so the
    round's time exceeds the latency the line reports. One line per committed round, none for a heal."""

    from xffl_like.hub.protocol.wire import GRPC_OPTIONS

    lines: list[str] = []
    fed = HubFederation(tmp_path / "state", None, log=lines.append)
    server, port = serve(fed, workers=8)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    try:
        a, b = Raw(channel, "a"), Raw(channel, "b")
        theta = torch.randn(N, generator=torch.Generator().manual_seed(0))
        a.join(spec_of(N)), a.upload("create", theta), b.join(spec_of(N))
        for version in (0, 1):
            step = 2 * (version + 1)
            rid = a.arrive(version, step)["round"]
            assert b.arrive(version, step)["round"] == rid
            assert a.upload("round", theta + 0.01, rid)["ok"]
            time.sleep(0.3)
            assert b.upload("round", theta - 0.01, rid)["ok"]
            for m in (a, b):  # both read the result: one line, at the first
                assert m.result(rid)[0]["status"] == "accepted"
        assert b.result(None)[0]["status"] == "healed"  # a heal outside a round: no line
    finally:
        channel.close()
        server.stop(grace=None)
        fed.close()
    pattern = re.escape(LINE).replace(r"\{\}", r"(\d+)").replace(r"\{:\.3f\}", r"([\d.]+)")
    pattern = pattern.replace(r"\{:\.2f\}", r"([\d.]+)")
    found = [m.groups() for line in lines if (m := re.fullmatch(pattern, line))]
    assert [(int(r), int(v)) for r, v, _, _ in found] == [(0, 1), (1, 2)], lines
    for _, _, latency, round_s in found:
        assert 0.0 <= float(latency) < float(round_s), found  # the round also waited 0.3 s for b's upload
        assert float(round_s) >= 0.3, found


def test_the_hubs_log_keeps_each_line_whole_across_threads():
    """The hub's log (``serve.line_log``) writes a line and its newline in one write under a lock: 4 threads logging
    at once into a stream that yields the GIL on every write (where ``print``'s two writes would interleave) give
    every line whole."""
    import threading
    import time

    from xffl_like.hub.server.serve import line_log

    class Slow:
        def __init__(self):
            self.parts: list[str] = []

        def write(self, s):
            time.sleep(0.0005)
            self.parts.append(s)

        def flush(self):
            pass

    out = Slow()
    log = line_log(out)
    threads = [threading.Thread(target=lambda t=t: [log(f"thread {t} line {i}") for i in range(40)]) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = "".join(out.parts).split("\n")[:-1]
    assert sorted(lines) == sorted(f"thread {t} line {i}" for t in range(4) for i in range(40))
