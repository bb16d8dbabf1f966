"""Issue 29, item 1: top-k with low-bit values and SparseLoCo's error feedback (``compression=topk``).

The codec (``xffl_like/federation/topk.py``) against a reference written here from the documented wire
format in numpy and Python integers, with no call into the codec: the same bytes, the same values. Then
the error-feedback invariant (residual + sent == accumulated, exactly in fp32), malformed messages,
the launcher's checks, and one job of 2 facilities x 1 process whose every round is recomputed here from
the messages its ranks recorded.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import TINY, run_recorded
from helpers.round_values import MIN_FACILITY_SPREAD, load_rounds
from helpers.topk_reference import TINIEST, keep, pack, ref_decode, ref_encode, ref_layout, topk_overrides, unpack

from xffl_like.config.schema import FederationConfig, build_section
from xffl_like.distributed.layout import plan_layout
from xffl_like.federation import validate_federation
from xffl_like.federation.topk import TopkCodec, TopkMean


def _bytes(message: torch.Tensor) -> bytes:
    return message.numpy().tobytes()


def _heavy(numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * torch.exp(3 * torch.randn(numel, generator=g))).float()


# ----------------------------------------------------------------------------- codec
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize(
    "numel, chunk, density",
    [(10000, 4096, 0.02), (1000, 64, 0.1), (257, 256, 0.3), (50, 7, 1.0), (300, 1, 0.5), (33, 4096, 0.02)],
)
def test_encode_decode_match_the_reference(numel, chunk, density, bits):
    x = _heavy(numel, numel + bits)
    codec = TopkCodec(numel, chunk, density, bits)
    message = codec.encode(x)
    want = ref_encode(x.numpy(), chunk, density, bits)
    assert message.dtype == torch.uint8 and codec.nbytes == len(want) == message.numel()
    assert _bytes(message) == want
    decoded = codec.decode(message)
    assert torch.equal(decoded, torch.from_numpy(ref_decode(want, numel, chunk, density, bits)))
    # Exact top-k per chunk: the kept positions are the k largest magnitudes (distinct here).
    for start, length, _ in ref_layout(numel, chunk, density, bits):
        k = keep(density, length)
        largest = set((start + torch.topk(x[start : start + length].abs(), k).indices).tolist())
        index = codec.decode_sparse(message)[0]
        assert set(index[(index >= start) & (index < start + length)].tolist()) == largest


def test_sizes_by_hand():
    """4096-value chunks at density 0.02 and 2 bits: 82 values, 4 + 82 x 12 / 8 + 82 x 2 / 8 -> 148 bytes;
    the short last chunk of 1808 values keeps ceil(36.16) = 37: 4 + 56 + 10 = 70."""
    codec = TopkCodec(10000, 4096, 0.02, 2)
    assert codec.index_bits == 12 and codec.keep(4096) == 82 and codec.row_bytes(4096) == 148
    assert codec.keep(1808) == 37 and codec.row_bytes(1808) == 70 and codec.nbytes == 2 * 148 + 70
    assert TopkCodec(10, 10, 0.3, 2).keep(10) == 3  # 0.3 x 10 is 3, not ceil(3.0000000000000004)
    assert TopkCodec(0, 4096, 0.02, 2).nbytes == 0


def test_ties_keep_the_lowest_indices():
    x = torch.tensor([1.0, -1.0, 1.0, 0.5, -1.0, 1.0, 2.0, -1.0], dtype=torch.float32)  # one chunk of 8
    codec = TopkCodec(8, 8, 0.5, 8)  # k = 4: the 2.0, then the three lowest of the tied 1.0s
    index, values = codec.decode_sparse(codec.encode(x))
    assert index.tolist() == [0, 1, 2, 6]
    assert _bytes(codec.encode(x)) == ref_encode(x.numpy(), 8, 0.5, 8)
    ones = torch.tensor([-3.0] * 5 + [3.0] * 5)  # all tied: the first k
    assert TopkCodec(10, 10, 0.2, 2).decode_sparse(TopkCodec(10, 10, 0.2, 2).encode(ones))[0].tolist() == [0, 1]


def test_all_zero_chunks():
    x = torch.zeros(300)
    x[200:] = torch.linspace(-1, 1, 100)
    codec = TopkCodec(300, 100, 0.05, 2)
    message = codec.encode(x)
    assert _bytes(message) == ref_encode(x.numpy(), 100, 0.05, 2)
    row = len(message) // 3
    scales = [np.frombuffer(_bytes(message)[i * row : i * row + 4], dtype="<f4")[0] for i in range(3)]
    assert scales[0] == scales[1] == 0 and scales[2] > 0
    index, values = codec.decode_sparse(message)
    assert index[:10].tolist() == [0, 1, 2, 3, 4, 100, 101, 102, 103, 104] and not values[:10].any()
    assert torch.equal(codec.decode(message)[:200], torch.zeros(200))


@pytest.mark.parametrize(
    "bits, values, want",
    [
        # 2 bits: scale = max(lower median |v| = 1, max |v| / 2 = 2) = 2; codes round(v / 2) clamped to -1..1
        (2, [4.0, 1.0, -3.0, 0.9], [2.0, 0.0, -2.0, 0.0]),
        # 4 bits: scale = 7 / 7 = 1; half to even: 3.5 -> 4, 2.5 -> 2, 0.5 -> 0
        (4, [7.0, 3.5, -1.0, 0.5, 2.5, -7.0], [7.0, 4.0, -1.0, 0.0, 2.0, -7.0]),
        # 8 bits: scale = 127 / 127 = 1
        (8, [127.0, -0.5, 1.5, 100.25, -126.75], [127.0, 0.0, 2.0, 100.0, -127.0]),
    ],
)
def test_rounding_by_hand(bits, values, want):
    x = torch.tensor(values, dtype=torch.float32)
    codec = TopkCodec(len(values), len(values), 1.0, bits)
    assert codec.decode(codec.encode(x)).tolist() == want


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_feedback_is_exact(bits):
    """SparseLoCo's accumulator: acc = decay * e + update; e = acc - sent. residual + sent == acc exactly
    (IEEE ==: no value is lost), the residual is acc where nothing was sent; inputs span fp32's range."""
    numel, decay = 5000, 0.9
    mean = TopkMean(numel, 1, 256, 0.05, bits, decay)
    for r in range(4):
        update = _heavy(numel, 100 + r) * 10.0 ** (4 * r - 30)  # 1e-30 (some subnormal) .. 1e-18 x heavy tails
        if r == 3:
            update[::97] = 3.0e38  # near fp32's largest
        update[1::89] = TINIEST.item()
        prev = mean.residual.clone()
        acc = prev * decay + update
        message = mean.prepare(update)
        assert _bytes(message) == ref_encode(acc.numpy(), 256, 0.05, bits)
        sent = torch.from_numpy(ref_decode(_bytes(message), numel, 256, 0.05, bits))
        assert torch.equal(mean.residual + sent, acc)
        assert torch.equal(mean.residual[sent == 0], acc[sent == 0])
        assert (sent != 0).any()
        delta, nbytes = mean.reduce(message, None, 0, [1.0])
        assert torch.equal(delta, sent) and nbytes == 0


def test_decode_stream_matches_decode():
    codec = TopkCodec(5000, 3, 0.4, 4)  # 1667 chunks: two blocks of full chunks and a short last one
    x = _heavy(5000, 7)
    data = _bytes(codec.encode(x))
    pos = 0

    def read(n):
        nonlocal pos
        pos += n
        return data[pos - n : pos]

    parts = list(codec.decode_stream(read))
    assert [s for s, _ in parts] == [0, 3072, 4998] and pos == len(data)
    assert torch.equal(torch.cat([v for _, v in parts]), codec.decode(codec.encode(x)))
    with pytest.raises(ValueError, match="bytes where chunks"):
        list(codec.decode_stream(lambda n: b"\0" * (n - 1)))


def _corrupt(codec, message, chunk, what):
    """A copy of ``message`` with chunk ``chunk``'s indices or header rewritten (by the reference layout)."""
    data = bytearray(_bytes(message))
    layout = ref_layout(codec.numel, codec.chunk_size, codec.density, codec.bits)
    offset = sum(row for _, _, row in layout[:chunk])
    start, length, row = layout[chunk]
    k = keep(codec.density, length)
    ib = codec.index_bits
    nidx = -(-k * ib // 8)
    if what == "scale":
        data[offset : offset + 4] = np.array([np.nan], dtype="<f4").tobytes()
    elif what == "code":
        data[offset + 4 + nidx : offset + row] = pack([2**codec.bits - 1] * k, codec.bits)
    else:
        index = unpack(bytes(data[offset + 4 : offset + 4 + nidx]), k, ib)
        index[-1] = length if what == "range" else index[0]
        data[offset + 4 : offset + 4 + nidx] = pack(index, ib)
    return torch.frombuffer(data, dtype=torch.uint8)


@pytest.mark.parametrize(
    "what, needle",
    [
        ("range", "chunk 2 has indices out of range (its 20 values) or not strictly increasing"),
        ("duplicate", "chunk 1 has indices out of range (its 40 values) or not strictly increasing (duplicated)"),
        ("scale", "chunk 1 has scale nan; a scale is finite and >= 0"),
        ("code", "chunk 2 has a value code above 2 (2 bits)"),
        ("length", "top-k message: 30 torch.uint8 bytes where the message has"),
    ],
)
def test_malformed_messages_are_refused(what, needle):
    codec = TopkCodec(100, 40, 0.25, 2)  # chunks of 40, 40, 20
    message = codec.encode(_heavy(100, 3))
    bad = message[:30] if what == "length" else _corrupt(codec, message, 2 if what in ("range", "code") else 1, what)
    with pytest.raises(ValueError) as err:
        codec.decode(bad)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_encode_refuses_non_finite_values():
    x = torch.zeros(100)
    x[55] = float("nan")
    with pytest.raises(ValueError, match="chunk 1 holds a non-finite value"):
        TopkCodec(100, 50, 0.1, 2).encode(x)


# ----------------------------------------------------------------------------- the launcher's checks
@pytest.mark.parametrize(
    "override, needle",
    [
        (dict(topk=dict(density=0)), "federation.topk.density=0: must be a number in (0, 1]"),
        (dict(topk=dict(density=1.5)), "federation.topk.density=1.5: must be a number in (0, 1]"),
        (dict(topk=dict(bits=3)), "federation.topk.bits=3: use 2, 4 or 8"),
        (dict(topk=dict(decay=1.5)), "federation.topk.decay=1.5: must be a number in [0, 1]"),
        (dict(error_feedback=False), "federation.error_feedback=false with federation.compression=topk"),
        (dict(topk=dict(density=0.02)), "federation.topk.density=0.02 x tile^2 (64x64) is not a whole number"),
        (dict(topk=dict(chunks="tiles", tile=0)), "federation.topk.tile=0: must be an integer in 1..4096"),
        (dict(topk=dict(mean="median")), "federation.topk.mean='median': use weighted or senders"),
        (dict(topk=dict(quantizer="ternary")), "federation.topk.quantizer='ternary': use levels or bins"),
        (
            dict(topk=dict(preset="sparseloco", decay=0.9)),
            "federation.topk.decay=0.9 contradicts federation/topk=sparseloco, which sets it to 0.95",
        ),
        (dict(topk=dict(preset="sparse")), "federation.topk.preset='sparse': use federation/topk=sparseloco"),
        (dict(topology="ring"), "compressed gossip is not supported"),
        (dict(every=4, fragments=2), "streaming rounds do not send top-k messages"),
        (dict(compression="uint8", topk=dict(bits=4)), "applies to federation.compression=topk, not uint8"),
    ],
)
def test_bad_topk_options(override, needle):
    spec = {"compression": "topk", "error_feedback": True, **override}
    with pytest.raises(ValueError) as err:
        validate_federation(build_section(FederationConfig, spec), plan_layout(4, 1, None))
    assert needle in str(err.value)


# ----------------------------------------------------------------------------- one job, every round by hand
CHUNK, DENSITY, BITS, DECAY = 1000, 0.6, 2, 0.9  # ternary levels over 60% of each chunk: some kept values go as 0


def _flat(record: dict) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in record["params"].values()])


@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_job_rounds_are_the_mean_of_the_decoded_messages(tmp_path):
    """2 facilities x 1 process, facility 0 taking 2 steps per round and facility 1 one (tokens weights
    2:1). Every round, from the recorded values and messages: each facility's message is the reference
    encoding of its accumulator (decay * residual + theta_global - theta_f), its recorded residual plus
    the decoded message is that accumulator exactly, and every copy after the round is
    theta_global - (2 d_0 + d_1) / 3 of the decoded messages (outer average at lr 1)."""
    _, summary = run_recorded(
        [
            "+experiment=llama_fed",
            *TINY,
            "logger=none",
            "distributed.nproc_per_node=2",
            "distributed.federated=1",
            "federation.every=[2,1]",
            "train.steps=4",
            "optim.warmup_steps=1",
            "train.eval_every=0",
            *topk_overrides(CHUNK, DENSITY, BITS, DECAY),
        ],
        tmp_path,
    )
    choices = {"mean": "weighted", "quantizer": "levels", "chunks": "flat", "tile": 64, "preset": None}
    assert summary["federation"]["topk"] == {"density": DENSITY, "bits": BITS, "decay": DECAY, **choices}
    assert [r["steps_taken"] for r in summary["round_records"]] == [[2, 1], [2, 1]]
    assert summary["max_param_divergence_after_last_round"] == 0.0
    recorded = load_rounds(tmp_path / "rounds")
    by_facility = lambda records: {r["facility"]: r for r in records}  # noqa: E731 (one rank per facility)
    init = by_facility(recorded[(0, "init")])
    theta = _flat(init[0])
    assert torch.equal(theta, _flat(init[1]))
    numel = theta.numel()
    nbytes = sum(row for _, _, row in ref_layout(numel, CHUNK, DENSITY, BITS))
    residual = {0: torch.zeros(numel), 1: torch.zeros(numel)}
    weights = torch.tensor([2.0, 1.0], dtype=torch.float64)
    spread = 0.0
    kept = sum(keep(DENSITY, length) for _, length, _ in ref_layout(numel, CHUNK, DENSITY, BITS))
    zero_shares = []  # per round, per facility: kept values sent as a zero code (kept indices are unique)
    for r in range(2):
        before, after = by_facility(recorded[(r, "before")]), by_facility(recorded[(r, "after")])
        decoded = {}
        for f in (0, 1):
            acc = residual[f] * DECAY + (theta - _flat(before[f]))
            message = after[f]["message"]
            assert message.numel() == nbytes and _bytes(message) == ref_encode(acc.numpy(), CHUNK, DENSITY, BITS)
            decoded[f] = torch.from_numpy(ref_decode(_bytes(message), numel, CHUNK, DENSITY, BITS))
            assert torch.equal(after[f]["residual"] + decoded[f], acc)
            residual[f] = after[f]["residual"]
        spread = max(spread, float((decoded[0] - decoded[1]).abs().max()))
        zero_shares.append([1 - int(torch.count_nonzero(decoded[f])) / kept for f in (0, 1)])
        mean = (weights[0] * decoded[0].double() + weights[1] * decoded[1].double()) / weights.sum()
        want = theta.double() - mean
        for f in (0, 1):
            err = float((_flat(after[f]).double() - want).abs().max())
            assert err <= 1e-6, f"round {r}, facility {f}: {err:.3g} from theta_global - the mean of the messages"
        assert torch.equal(_flat(after[0]), _flat(after[1]))
        assert after[0]["bytes_per_rank"] == nbytes and summary["cross_facility_bytes_per_round"][r] == 2 * nbytes
        theta = _flat(after[0])
    assert spread > MIN_FACILITY_SPREAD  # the facilities sent different updates
    assert summary["federation"]["topk_zero_codes"] == [pytest.approx(row, abs=1e-12) for row in zero_shares]
    assert any(share > 0 for row in zero_shares for share in row)  # ternary codes at 2 bits: some are zeros
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds"] == 2


@pytest.mark.parametrize("kind, topk", [("topk", (0.05, 2)), ("topk", (0.3, 8)), ("uint8", None), ("bf16", None)])
def test_the_hubs_codec_encodes_window_by_window_the_bytes_of_the_whole(kind, topk):
    """A facility leader encodes its update for the hub a window at a time (it never holds the whole message):
    the windows' bytes are the whole message's, they decode to its values, and so does the hub's stream."""
    import io

    from xffl_like.hub.protocol.update_codec import UpdateCodec

    numel = 10_007
    codec = UpdateCodec(kind, numel, 100, topk)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    whole = codec.encode(x)
    assert whole.numel() == codec.nbytes
    if kind == "topk":
        assert bytes(whole.numpy()) == ref_encode(x.numpy(), 100, *topk)
    windows = codec.windows(1000)
    assert len(windows) > 1 and [s for s, _ in windows] == list(range(0, numel, windows[0][1]))
    parts = [codec.encode_window(x[s : s + n], s) for s, n in windows]
    assert torch.equal(torch.cat(parts), whole)
    decoded = [codec.decode_window(m, s, n) for m, (s, n) in zip(parts, windows)]
    assert torch.equal(torch.cat(decoded), codec.decode(whole))
    stream = torch.cat([v for _, v in codec.decode_stream(io.BytesIO(whole.numpy().tobytes()).read)])
    assert torch.equal(stream[:numel], codec.decode(whole))
