"""Issue 39, item 1: top-k as SparseLoCo does it (``federation/topk=sparseloco``: 64x64 tiles, 4 bins per
tensor, the per-index mean over the senders, SGD at lr 1, error feedback 0.95).

The codec and a one-world job of 3 facilities against ``tests/helpers/sparseloco_reference.py``, SparseLoCo's
published algorithm step by step in numpy with no call into ``xffl_like``. The tolerance is for float order
only (numpy sums means and deviations in float64, torch in float32); copies are compared bit for bit.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from helpers import TINY, run_recorded, validated_federation
from helpers.round_values import MIN_FACILITY_SPREAD, load_rounds
from helpers.sparseloco_reference import compress, outer_round, ref_decode, ref_encode, tile_positions

from xffl_like.federation.topk import TopkFold, TopkMean, fold_weights
from xffl_like.federation.topk_tensors import TensorCodec, TopkOptions
from xffl_like.hub.protocol import relay
from xffl_like.hub.protocol.update_codec import UpdateCodec

PRESET = TopkOptions(0.03125, 2, 64)
# 64x64 tiles (k 128), 48x64 (k 96), 1-D runs of 64 (k 2) and of 50 (k round(1.5625) = 2), 50x30 (k 47).
SHAPES = [(128, 192), (96, 64), (64,), (100,), (50, 30)]
ATOL = 0.0  # the codec sums its bins' statistics in float64, as the reference does: the same bits


def _heavy(shape, rng) -> np.ndarray:
    return (rng.standard_t(3, size=shape) * 0.01).astype(np.float32)


def _flat(tensors) -> torch.Tensor:
    return torch.cat([torch.as_tensor(np.asarray(t)).reshape(-1) for t in tensors])


def test_tiles_are_the_references():
    """Each tensor's chunks are SparseLoCo's tiles: the codec keeps exactly the reference's positions, and its
    message is as small as documented (4 bytes a bin and the shift per tensor, 12-bit indices, 2-bit codes)."""
    rng = np.random.default_rng(1)
    x = [_heavy(s, rng) for s in SHAPES]
    numel = sum(t.size for t in x)
    codec = TensorCodec(numel, PRESET, SHAPES)
    index, _ = codec.decode_sparse(codec.encode(_flat(x)))
    want, offset = [], 0
    for t, shape in zip(x, SHAPES):
        want.append(offset + compress(t.reshape(-1).copy(), shape)[0])
        offset += t.size
    assert sorted(index.tolist()) == sorted(np.concatenate(want).tolist())
    sizes = {(128, 192): 6 * (128 * 12 // 8 + 128 * 2 // 8), (96, 64): 2 * (96 * 12 // 8 + 96 * 2 // 8)}
    sizes |= {(64,): 2 + 1, (100,): 2 * (2 + 1), (50, 30): 47 * 11 // 8 + 1 + -(-47 * 2 // 8)}
    assert codec.nbytes == sum(20 + sizes[s] for s in SHAPES)
    assert tile_positions((96, 64)).shape == (2, 48 * 64)


def test_codec_rounds_follow_the_published_algorithm():
    """3 facilities, 3 rounds: each facility's :class:`TopkMean` accumulator (decay 0.95) and message, the
    fold of the messages (:class:`TopkFold`, ``senders``) and SGD at lr 1 against the numpy reference."""
    rng = np.random.default_rng(0)
    theta_ref = [rng.standard_normal(s).astype(np.float32) * 0.1 for s in SHAPES]
    numel = sum(t.size for t in theta_ref)
    theta = _flat(theta_ref).clone()
    errors = [[np.zeros(t.size, dtype=np.float32) for t in theta_ref] for _ in range(3)]
    codec = TensorCodec(numel, PRESET, SHAPES)
    facilities = [TopkMean(codec, 3, 0.95) for _ in range(3)]
    for r in range(3):
        updates = [[_heavy(s, rng) for s in SHAPES] for _ in range(3)]
        local_ref = [[g - u for g, u in zip(theta_ref, us)] for us in updates]
        messages = [m.prepare(theta - (theta - _flat(us))) for m, us in zip(facilities, updates)]
        fold = TopkFold(torch.zeros(numel))
        for message, w in zip(messages, fold_weights([1 / 3] * 3)):
            fold.add(*codec.decode_sparse(message), w)
        theta = theta - 1.0 * fold.finish()
        theta_ref = outer_round(theta_ref, local_ref, errors)
        err = float((theta - _flat(theta_ref)).abs().max())
        assert err <= ATOL, f"round {r}: {err:.3g} from the reference"
        for f in range(3):
            assert float((facilities[f].residual - _flat(errors[f])).abs().max()) <= ATOL
        assert float(fold.out.abs().max()) > 1e-3  # the round moved the model


def test_disjoint_senders_keep_their_values_whole():
    """Two facilities with disjoint supports: each value lands whole (a mean weighted over all facilities would
    halve it); a value both sent is their mean, and with weights 3:1 their weighted mean."""
    codec = TensorCodec(4, TopkOptions(1.0, 2, 4), [(4,)])
    a, b = torch.tensor([4.0, 0, 0, 0]), torch.tensor([2.0, 6.0, 0, 0])
    index = torch.tensor([0, 1])
    for weights, want in (([1.0, 1.0], [3.0, 6.0, 0.0, 0.0]), ([3.0, 1.0], [3.5, 6.0, 0.0, 0.0])):
        fold = TopkFold(torch.zeros(4))
        for x, w, sent in zip((a, b), fold_weights(weights), (index[:1], index)):
            fold.add(sent, x[sent], w)
        assert fold.finish().tolist() == want
    assert fold_weights([0.5, 0.5, 0.0]) == [1.0, 1.0, 0.0] and fold_weights([0.75, 0.25]) == [0.75, 0.25]
    assert codec.nbytes == 20 + 1 + 1  # a run of 4 values: 4 indices of 2 bits, 4 codes of 2 bits


@pytest.mark.parametrize("opts", [PRESET, TopkOptions(0.0625, 4, 16)])
def test_the_hubs_codec_reads_what_the_facility_wrote(opts):
    """The hub's :class:`UpdateCodec` of the same options and shapes: the same bytes, a decode stream equal to
    the decoded message, and a relay fold, a window at a time, equal to the one-world fold of the whole messages."""
    rng = np.random.default_rng(2)
    xs = [_flat([_heavy(s, rng) for s in SHAPES]) for _ in range(2)]
    numel = xs[0].numel()
    hub = UpdateCodec("topk", numel, 1000, opts, [list(s) for s in SHAPES])
    mine = TensorCodec(numel, opts, SHAPES)
    messages = [mine.encode(x) for x in xs]
    assert all(torch.equal(hub.encode(x), m) for x, m in zip(xs, messages))
    assert torch.equal(torch.cat([hub.encode_window(xs[0][s : s + n], s) for s, n in hub.windows(1000)]), messages[0])
    stream = torch.cat([v for _, v in hub.decode_stream(io.BytesIO(messages[0].numpy().tobytes()).read)])
    assert torch.equal(stream, mine.decode(messages[0]))
    for scales in ([0.5, 0.5], [0.75, 0.25]):  # equal weights count 1 each; unequal ones as given
        readers = [relay.Reader(io.BytesIO(m.numpy().tobytes()), hub) for m in messages]
        windows = []
        for start in range(0, numel, 777):  # the relay's windows cut across tensors and tiles
            windows.append(torch.empty(min(777, numel - start)))
            relay.fold(windows[-1], readers, scales, "mean", 0.0)
        one = TopkFold(torch.zeros(numel))
        for m, w in zip(messages, fold_weights(scales)):
            one.add(*mine.decode_sparse(m), w)
        assert torch.equal(torch.cat(windows), one.finish())


def test_the_leader_encodes_whole_tensors_a_window_at_a_time(monkeypatch):
    """The hub's leader encodes and decodes its update a window of whole tensors at a time (it never holds the whole
    model): windows of at most ``about`` values unless one tensor is larger, whose bytes are the whole message's and
    the numpy reference's (SparseLoCo's tiles and bins per tensor; a tensor's tiles ranked a band of rows of tiles
    at a time), whose values are the reference's, and whose residual is the update less them where they were sent."""
    from xffl_like.federation import topk_tensors

    monkeypatch.setattr(topk_tensors, "_BAND", 4096)  # 2 bands of 1 row of tiles in (128, 192) and in (96, 64)
    monkeypatch.setattr(topk_tensors, "_ROWS", 2)  # the tiles' indices and codes packed 2 tiles at a time
    rng = np.random.default_rng(4)
    x = [_heavy(s, rng) for s in SHAPES]
    numel = sum(t.size for t in x)
    codec = UpdateCodec("topk", numel, 4096, PRESET, [list(s) for s in SHAPES])
    windows = codec.windows(7000)  # 24576 values alone; 6144 + 64 + 100 together; 1500
    bounds = np.cumsum([0] + [t.size for t in x]).tolist()
    assert windows == [(0, 24576), (24576, 6308), (30884, 1500)]
    assert all(s in bounds and s + n in bounds for s, n in windows)
    flat = _flat(x)
    parts = [codec.encode_window(flat[s : s + n], s) for s, n in windows]
    assert torch.equal(torch.cat(parts), codec.encode(flat))
    assert codec.encode(flat).numpy().tobytes() == ref_encode(flat.numpy(), SHAPES)
    decoded = torch.cat([codec.decode_window(m, s, n) for m, (s, n) in zip(parts, windows)])
    assert torch.equal(decoded, codec.decode(codec.encode(flat)))
    want = np.zeros(numel, dtype=np.float32)
    for t, start in zip(x, bounds):
        sent, values = compress(t.reshape(-1).copy(), t.shape)
        want[start + sent] = values
    assert np.array_equal(decoded.numpy(), want) and np.count_nonzero(want) == 768 + 192 + 2 + 4 + 47
    residual = torch.cat([codec.take_sent(flat[s : s + n].clone(), m, s) for m, (s, n) in zip(parts, windows)])
    sent = ref_decode(ref_encode(flat.numpy(), SHAPES), SHAPES)[1]
    assert np.array_equal(residual.numpy()[~sent], flat.numpy()[~sent])
    assert np.array_equal(residual.numpy()[sent], flat.numpy()[sent] - want[sent])
    with pytest.raises(ValueError, match="cuts a tensor"):
        codec.encode_window(flat[:1000], 0)


@pytest.mark.parametrize("bits, density, tile", [(2, 0.03125, 64), (4, 0.05, 20), (8, 0.25, 8), (2, 1.0, 4)])
def test_the_bytes_are_the_references(bits, density, tile):
    """The message, byte for byte, is the numpy reference's encoding of SparseLoCo's tiles and bins in the documented
    format (tests/helpers/sparseloco_reference.py), and decodes to the reference's values."""
    rng = np.random.default_rng(bits)
    flat = _flat([_heavy(s, rng) for s in SHAPES])
    codec = TensorCodec(flat.numel(), TopkOptions(density, bits, tile), SHAPES)
    message, want = codec.encode(flat), ref_encode(flat.numpy(), SHAPES, density, tile, bits)
    assert message.numpy().tobytes() == want and codec.nbytes == len(want)
    values, sent = ref_decode(want, SHAPES, density, tile, bits)
    assert np.array_equal(codec.decode(message).numpy(), values)
    assert sorted(codec.decode_sparse(message)[0].tolist()) == np.flatnonzero(sent).tolist()


@pytest.mark.parametrize(
    "what, needle",
    [("lookup", "header holds a non-finite"), ("index", "indices out of range"), ("short", "bytes where tensor")],
)
def test_malformed_messages_are_refused(what, needle):
    codec = TensorCodec(192 * 128, PRESET, [(128, 192)])
    message = codec.encode(torch.randn(192 * 128)).clone()
    if what == "lookup":
        message[4:8] = torch.tensor([float("nan")]).view(torch.uint8)
    elif what == "index":
        message[20:23] = 0  # the first two 12-bit indices of tile 0 both 0
    else:
        message = message[:-1]
        with pytest.raises(ValueError, match=needle):
            list(codec.decode_stream(io.BytesIO(message.numpy().tobytes()).read))
        return
    with pytest.raises(ValueError, match=needle):
        codec.decode(message)


# ----------------------------------------------------------------------------- one world, 3 facilities
@pytest.mark.cli
@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_world_job_follows_the_published_algorithm(tmp_path):
    """3 facilities x 1 process on gloo with ``federation/topk=sparseloco``, 3 rounds: every facility's
    parameters after each round are the numpy reference's step from the recorded parameters (its own error
    accumulators carried across rounds), and the 3 copies are equal bit for bit."""
    _, summary = run_recorded(
        [
            "+experiment=llama_fed",
            *TINY,
            "logger=none",
            "distributed.nproc_per_node=3",
            "distributed.federated=1",
            "federation.every=2",
            "train.steps=6",
            "optim.warmup_steps=1",
            "train.eval_every=0",
            "federation/topk=sparseloco",
        ],
        tmp_path,
    )
    assert summary["max_param_divergence_after_last_round"] == 0.0
    recorded = load_rounds(tmp_path / "rounds")
    by_facility = lambda records: {r["facility"]: r for r in records}  # noqa: E731 (one rank per facility)
    init = by_facility(recorded[(0, "init")])
    names = list(init[0]["params"])
    theta = [init[0]["params"][n].numpy() for n in names]
    errors = [[np.zeros(t.size, dtype=np.float32) for t in theta] for _ in range(3)]
    spread = 0.0
    for r in range(3):
        before, after = by_facility(recorded[(r, "before")]), by_facility(recorded[(r, "after")])
        local = [[before[f]["params"][n].numpy() for n in names] for f in range(3)]
        spread = max(spread, max(float(np.abs(a - b).max()) for a, b in zip(local[0], local[1])))
        want = outer_round(theta, local, errors)
        for f in range(3):
            got = [after[f]["params"][n].numpy() for n in names]
            err = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
            assert err <= ATOL, f"round {r}, facility {f}: {err:.3g} from the reference"
            assert all(np.array_equal(g, h) for g, h in zip(got, [after[0]["params"][n].numpy() for n in names]))
        theta = [after[0]["params"][n].numpy() for n in names]
    assert spread > MIN_FACILITY_SPREAD


# ----------------------------------------------------------------------------- configuration
def test_the_preset_sets_every_choice_and_topk_alone_carries_its_feedback():
    cfg = validated_federation(["federation/topk=sparseloco"])
    assert (cfg.compression, cfg.feedback, cfg.outer.name, cfg.outer.lr) == ("topk", True, "average", 1.0)
    t = cfg.topk
    choices = lambda t: (t.density, t.bits, t.decay, t.tile, t.chunks, t.quantizer)  # noqa: E731
    assert choices(t) == (0.03125, 2, 0.95, 64, "tiles", "bins")
    alone = validated_federation(["federation.compression=topk"])
    assert alone.error_feedback is None and alone.feedback  # topk's accumulator, without spelling it out
    assert choices(alone.topk) == choices(t) and (alone.outer.name, alone.outer.lr) == ("average", 1.0)  # the default
    assert not validated_federation(["federation.compression=uint8"]).feedback  # the others' default is unchanged
    assert validated_federation(
        ["+experiment=diloco", "federation/topk=sparseloco", "federation.outer.lr=1.0"]
    ).topk.preset


def test_a_key_set_after_the_preset_is_refused_in_one_line():
    with pytest.raises(ValueError) as err:
        validated_federation(["+experiment=diloco", "federation/topk=sparseloco"])  # the experiment's outer lr 0.8
    line = str(err.value)
    assert "\n" not in line and line.startswith("federation.outer.lr=0.8 contradicts federation/topk=sparseloco")
