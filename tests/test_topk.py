"""Issues 29 and 39: top-k with low-bit values and SparseLoCo's error feedback (``compression=topk``).

The codec's details by hand (ties, tensors of zeros, the bins of a few values, non-finite input) and its error
feedback against ``tests/helpers/sparseloco_reference.py`` (numpy, no call into the codec); the launcher's checks;
one job of 2 facilities x 1 process whose every round is recomputed here from the messages its ranks recorded;
the other codecs' windows at a facility's leader. SparseLoCo's algorithm itself: ``test_topk_sparseloco.py``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import TINY, run_recorded
from helpers.round_values import MIN_FACILITY_SPREAD, load_rounds
from helpers.sparseloco_reference import kept as ref_kept
from helpers.sparseloco_reference import pieces, ref_decode, ref_encode, sender_mean, topk_overrides

from xffl_like.config.schema import FederationConfig, build_section
from xffl_like.distributed.layout import plan_layout
from xffl_like.federation import validate_federation
from xffl_like.federation.topk import TopkMean
from xffl_like.federation.topk_tensors import TensorCodec, TopkOptions


def _bytes(message: torch.Tensor) -> bytes:
    return message.numpy().tobytes()


def _heavy(numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * torch.exp(3 * torch.randn(numel, generator=g))).float()


# ----------------------------------------------------------------------------- codec
def test_ties_keep_the_lowest_indices():
    x = torch.tensor([1.0, -1.0, 1.0, 0.5, -1.0, 1.0, 2.0, -1.0], dtype=torch.float32)  # one run of 8
    codec = TensorCodec(8, TopkOptions(0.5, 8, 8), [(8,)])  # k = 4: the 2.0, then the three lowest of the tied 1.0s
    index, _ = codec.decode_sparse(codec.encode(x))
    assert index.tolist() == [0, 1, 2, 6]
    assert _bytes(codec.encode(x)) == ref_encode(x.numpy(), [(8,)], 0.5, 8, 8)
    ones = torch.tensor([-3.0] * 5 + [3.0] * 5)  # all tied: the first k
    codec = TensorCodec(10, TopkOptions(0.2, 2, 10), [(10,)])
    assert codec.decode_sparse(codec.encode(ones))[0].tolist() == [0, 1]


def test_a_tensor_of_zeros_sends_zeros():
    """A tensor whose update is zero (say, embedding rows never used) keeps its first k of each tile, all decoded
    to 0 (shift 0, sigma 0: the scale falls back to 1), beside a tensor that is not."""
    x = torch.zeros(300)
    x[200:] = torch.linspace(-1, 1, 100)
    shapes = [(2, 100), (100,)]
    codec = TensorCodec(300, TopkOptions(0.0625, 2, 16), shapes)  # tiles of 2 x 10 (k 1), runs of 10 (k 1)
    message = codec.encode(x)
    assert _bytes(message) == ref_encode(x.numpy(), shapes, 0.0625, 16, 2)
    assert np.frombuffer(_bytes(message)[:20], dtype="<f4").tolist() == [0.0] * 5  # shift and the 4 bins
    index, values = codec.decode_sparse(message)
    assert index[:10].tolist() == [0, 10, 20, 30, 40, 50, 60, 70, 80, 90] and not values[:10].any()
    assert values[10:].any()


def test_bins_by_hand():
    """8 kept values: shift = mean = 1, the centred values' unbiased sigma sqrt(252 / 7) = 6, scale 6 sigma / 4 = 9;
    codes round(c / scale + 2): 11 -> 3, 2..-2 -> 2, -11 -> 1 (bin 0 empty); each decodes to its bin's mean."""
    x = torch.tensor([12.0, 3.0, 2.0, 1.0, 0.0, -1.0, 1.0, -10.0])
    codec = TensorCodec(8, TopkOptions(1.0, 2, 8), [(8,)])
    head = np.frombuffer(_bytes(codec.encode(x))[:20], dtype="<f4")
    assert head.tolist() == [1.0, 0.0, -11.0, 0.0, 11.0]
    assert codec.decode(codec.encode(x)).tolist() == [12.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -10.0]


def test_encode_refuses_non_finite_values():
    x = torch.zeros(100)
    x[55] = float("nan")
    with pytest.raises(ValueError, match="value 55 is not finite"):
        TensorCodec(100, TopkOptions(0.1, 2, 10), [(100,)]).encode(x)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_error_feedback_follows_the_reference(bits):
    """SparseLoCo's accumulator: acc = decay * e + update; the message is the reference's encoding of acc; e becomes
    acc minus the decoded value where one was sent, acc elsewhere (float32); inputs span fp32's range."""
    shapes, decay = [(40, 100), (1000,)], 0.9
    numel = 5000
    mean = TopkMean(TensorCodec(numel, TopkOptions(0.0625, bits, 20), shapes), 1, decay)
    for r in range(4):
        update = _heavy(numel, 100 + r) * 10.0 ** (4 * r - 30)  # 1e-30 (some subnormal) .. 1e-18 x heavy tails
        if r == 3:
            update[::97] = 1.0e30
        acc = mean.residual * decay + update
        message = mean.prepare(update)
        assert _bytes(message) == ref_encode(acc.numpy(), shapes, 0.0625, 20, bits)
        values, sent = ref_decode(_bytes(message), shapes, 0.0625, 20, bits)
        want = acc.numpy().copy()
        want[sent] = want[sent] - values[sent]
        assert np.array_equal(mean.residual.numpy(), want) and sent.sum() == 10 * 25 + 50 * 1
        delta, nbytes = mean.reduce(message, None, 0, [1.0])
        assert np.array_equal(delta.numpy(), values) and nbytes == 0


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
        (dict(topk=dict(tile=0)), "federation.topk.tile=0: must be an integer in 1..4096"),
        (dict(topk=dict(chunks="rows")), "federation.topk.chunks='rows': use tiles or flat"),
        (dict(topk=dict(quantizer="ternary")), "federation.topk.quantizer='ternary': use bins or levels"),
        (
            dict(topk=dict(preset="sparseloco", chunks="flat")),
            "federation.topk.chunks='flat' contradicts federation/topk=sparseloco, which sets it to 'tiles'",
        ),
        (
            dict(topk=dict(preset="sparseloco", decay=0.9)),
            "federation.topk.decay=0.9 contradicts federation/topk=sparseloco, which sets it to 0.95",
        ),
        (dict(topk=dict(preset="sparse")), "federation.topk.preset='sparse': use federation/topk=sparseloco or flat"),
        (dict(topology="ring"), "compressed gossip is not supported"),
        (dict(every=4, fragments=2), "streaming rounds do not send top-k messages"),
        (dict(compression="uint8", topk=dict(bits=4)), "applies to federation.compression=topk, not uint8"),
    ],
)
def test_bad_topk_options(override, needle):
    spec = {"compression": "topk", "error_feedback": True, **override}
    with pytest.raises(ValueError) as err:
        validate_federation(build_section(FederationConfig, spec), plan_layout(4, 1, None))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_flat_chunks_take_any_density():
    """A density whose share of a full tile is not whole is refused with tiles only: flat chunks keep
    ceil(density x chunk_size)."""
    spec = {"compression": "topk", "topk": {"chunks": "flat", "quantizer": "levels", "density": 0.02}}
    validate_federation(build_section(FederationConfig, spec), plan_layout(4, 1, None))


# ----------------------------------------------------------------------------- one job, every round by hand
#: Flat chunks of 1000 values (250 kept, levels -s, 0, s; the last chunk shorter), each rank's whole vector.
DENSITY, BITS, DECAY, CHUNK = 0.25, 2, 0.9, 1000
CHOICES = dict(chunks="flat", quantizer="levels", chunk=CHUNK)


def _flat(record: dict) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in record["params"].values()])


@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_job_rounds_are_the_mean_of_the_decoded_messages(tmp_path):
    """2 facilities x 1 process, facility 0 taking 2 steps per round and facility 1 one (tokens weights 2:1), with flat
    chunks and levels (:data:`CHOICES`). Every round, from the recorded values and messages: each facility's message is
    the reference encoding of its accumulator (decay * residual + theta_global - theta_f), bitwise; its recorded
    residual is that accumulator less the decoded values where they were sent; every copy after the round is
    theta_global minus, per index, the 2:1-weighted mean over the facilities that sent it (outer average at lr 1)."""
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
            *topk_overrides(DENSITY, BITS, DECAY, **CHOICES),
        ],
        tmp_path,
    )
    assert summary["federation"]["topk"] == {"density": DENSITY, "bits": BITS, "decay": DECAY, "tile": 64,
                                             "chunks": "flat", "quantizer": "levels", "preset": None}  # fmt: skip
    assert [r["steps_taken"] for r in summary["round_records"]] == [[2, 1], [2, 1]]
    assert summary["max_param_divergence_after_last_round"] == 0.0
    recorded = load_rounds(tmp_path / "rounds")
    by_facility = lambda records: {r["facility"]: r for r in records}  # noqa: E731 (one rank per facility)
    init = by_facility(recorded[(0, "init")])
    theta = _flat(init[0])
    assert torch.equal(theta, _flat(init[1]))
    shapes = [tuple(t.shape) for t in init[0]["params"].values()]
    codec = dict(density=DENSITY, bits=BITS, **CHOICES)
    nbytes = len(ref_encode(theta.numpy(), shapes, **codec))
    kept = sum(len(p) * ref_kept(p.shape[1], DENSITY, "flat") for p in pieces(shapes, chunks="flat", chunk=CHUNK))
    residual = {0: np.zeros(theta.numel(), dtype=np.float32), 1: np.zeros(theta.numel(), dtype=np.float32)}
    spread = 0.0
    zero_shares = []  # per round, per facility: kept values sent as a zero code (kept indices are unique)
    for r in range(2):
        before, after = by_facility(recorded[(r, "before")]), by_facility(recorded[(r, "after")])
        decoded, sent = {}, {}
        for f in (0, 1):
            acc = residual[f] * np.float32(DECAY) + (theta - _flat(before[f])).numpy()
            message = after[f]["message"]
            assert message.numel() == nbytes and _bytes(message) == ref_encode(acc, shapes, **codec)
            decoded[f], sent[f] = ref_decode(_bytes(message), shapes, **codec)
            acc[sent[f]] -= decoded[f][sent[f]]
            assert np.array_equal(after[f]["residual"].numpy(), acc)
            residual[f] = acc
        spread = max(spread, float(np.abs(decoded[0] - decoded[1]).max()))
        zero_shares.append([1 - int(np.count_nonzero(decoded[f])) / kept for f in (0, 1)])
        want = theta.double().numpy() - sender_mean([decoded[0], decoded[1]], [sent[0], sent[1]], [2.0, 1.0])
        for f in (0, 1):
            err = float(np.abs(_flat(after[f]).double().numpy() - want).max())
            assert err <= 1e-6, f"round {r}, facility {f}: {err:.3g} from theta_global - the mean of the messages"
        assert torch.equal(_flat(after[0]), _flat(after[1]))
        assert after[0]["bytes_per_rank"] == nbytes and summary["cross_facility_bytes_per_round"][r] == 2 * nbytes
        theta = _flat(after[0])
    assert spread > MIN_FACILITY_SPREAD  # the facilities sent different updates
    assert summary["federation"]["topk_zero_codes"] == [pytest.approx(row, abs=1e-12) for row in zero_shares]
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["rounds"] == 2


@pytest.mark.parametrize("kind", ["uint8", "bf16"])
def test_the_hubs_codec_encodes_window_by_window_the_bytes_of_the_whole(kind):
    """A facility leader encodes its update for the hub a window at a time (it never holds the whole message):
    the windows' bytes are the whole message's, they decode to its values, and so does the hub's stream (top-k's
    windows of whole tensors: test_topk_sparseloco.py)."""
    import io

    from xffl_like.hub.protocol.update_codec import UpdateCodec

    numel = 10_007
    codec = UpdateCodec(kind, numel, 100)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(3))
    whole = codec.encode(x)
    assert whole.numel() == codec.nbytes
    windows = codec.windows(1000)
    assert len(windows) > 1 and [s for s, _ in windows] == list(range(0, numel, windows[0][1]))
    parts = [codec.encode_window(x[s : s + n], s) for s, n in windows]
    assert torch.equal(torch.cat(parts), whole)
    decoded = [codec.decode_window(m, s, n) for m, (s, n) in zip(parts, windows)]
    assert torch.equal(torch.cat(decoded), codec.decode(whole))
    stream = torch.cat([v for _, v in codec.decode_stream(io.BytesIO(whole.numpy().tobytes()).read)])
    assert torch.equal(stream[:numel], codec.decode(whole))
