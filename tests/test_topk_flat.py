"""Issue 39: top-k's flat chunks and symmetric levels (``federation.topk.chunks=flat``, ``quantizer=levels``), the
choices of before SparseLoCo's that measured better at 960 steps, as choices of today's codec with the per-index
mean over the senders.

The codec against ``tests/helpers/sparseloco_reference.py`` (numpy and Python integers, no call into the codec):
its bytes, its values, its error feedback; the levels by hand; malformed messages; the hub's codec and relay of the
same options; the launcher's and the hub's checks. A job through the hub with these choices:
``test_elastic.py::test_topk_through_the_hub``; one world: ``test_topk.py``.
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
from helpers import validated_federation
from helpers.sparseloco_reference import compress_all, pieces, ref_decode, ref_encode

from xffl_like.federation.topk import TopkFold, TopkMean, fold_weights
from xffl_like.federation.topk_tensors import TensorCodec, TopkOptions
from xffl_like.hub.protocol import relay
from xffl_like.hub.protocol.update_codec import UpdateCodec

SHAPES = [(128, 192), (96, 64), (64,), (100,), (50, 30)]  # 32,264 values


def _heavy(numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g) * torch.exp(3 * torch.randn(numel, generator=g))).float()


def _options(chunks: str, quantizer: str, density: float, bits: int, chunk: int = 4096, tile: int = 64):
    return TopkOptions(density, bits, tile, chunks, quantizer, chunk)


def _reference(opts: TopkOptions) -> dict:
    return dict(density=opts.density, tile=opts.tile, bits=opts.bits, chunks=opts.chunks, quantizer=opts.quantizer,
                chunk=opts.chunk_size)  # fmt: skip


CASES = [  # (chunks, quantizer, density, bits, chunk): a tail chunk in each flat case
    ("flat", "levels", 0.02, 2, 4096),  # 82 of each 4096-value chunk, levels -s, 0, s
    ("flat", "levels", 0.1, 4, 1000),
    ("flat", "levels", 0.3, 8, 333),  # ceil(99.9) = 100 kept
    ("flat", "bins", 0.03125, 2, 4096),
    ("tiles", "levels", 0.03125, 2, 4096),
]


@pytest.mark.parametrize("chunks, quantizer, density, bits, chunk", CASES)
def test_the_bytes_are_the_references(chunks, quantizer, density, bits, chunk):
    """The message, byte for byte, is the reference's encoding in the documented format, and decodes to the
    reference's values at the reference's positions."""
    opts = _options(chunks, quantizer, density, bits, chunk)
    x = _heavy(sum(int(np.prod(s)) for s in SHAPES), bits)
    codec = TensorCodec(x.numel(), opts, SHAPES)
    message, want = codec.encode(x), ref_encode(x.numpy(), SHAPES, **_reference(opts))
    assert message.numpy().tobytes() == want and codec.nbytes == len(want)
    values, sent = ref_decode(want, SHAPES, **_reference(opts))
    assert np.array_equal(codec.decode(message).numpy(), values)
    assert sorted(codec.decode_sparse(message)[0].tolist()) == np.flatnonzero(sent).tolist()


def test_flat_chunks_run_in_bands_of_whole_chunks():
    """Chunks of 2**19 values: runs of 2 full chunks (2**20 values), then the last run of one, then the tail; each
    run's bytes are the reference's (here with bins, whose statistics are the run's)."""
    chunk = 1 << 19
    numel = 3 * chunk + 1000
    assert [p.shape for p in pieces([(numel,)], chunks="flat", chunk=chunk)] == [(2, chunk), (1, chunk), (1, 1000)]
    for quantizer in ("bins", "levels"):
        opts = _options("flat", quantizer, 0.0001, 2, chunk)  # ceil(52.4288) = 53 kept of a chunk, 1 of the tail
        x = _heavy(numel, 7)
        codec = TensorCodec(numel, opts, [(numel,)])
        assert [(b.rows, b.cols) for b in codec.blocks] == [(2, chunk), (1, chunk), (1, 1000)]
        assert codec.encode(x).numpy().tobytes() == ref_encode(x.numpy(), [(numel,)], **_reference(opts))


def test_levels_by_hand():
    """One chunk of 4 values at density 0.75 keeps 3: -3, 2, 0.5. 2 bits: s = max(lower median 2, max 3 / 2) = 2;
    codes round(v / s) = -1.5 -> -2, clamped to -1; 1; 0.25 -> 0: decoded -2, 2, 0. The accumulator keeps
    0.1 (not sent), -1, 0 and 0.5 (sent as 0). 4 bits: Q = 7, s = 3 / 7."""
    x = torch.tensor([0.1, -3.0, 2.0, 0.5])
    mean = TopkMean(TensorCodec(4, _options("flat", "levels", 0.75, 2, 4)), 1, 0.0)
    message = mean.prepare(x)
    index, values = mean.codec.decode_sparse(message)
    assert index.tolist() == [1, 2, 3] and values.tolist() == [-2.0, 2.0, 0.0]
    assert mean.residual.tolist() == [pytest.approx(0.1), -1.0, 0.0, 0.5] and mean.zero_codes == [(1, 3)]
    assert message[:4].view(torch.float32).item() == 2.0 and mean.codec.nbytes == 4 + 1 + 1  # scale, 3x2, 3x2 bits
    four = TensorCodec(4, _options("flat", "levels", 0.75, 4, 4))
    s = np.float32(3) / np.float32(7)
    want = [float(np.float32(-7) * s), float(np.float32(np.rint(np.float32(2) / s)) * s), float(np.float32(1) * s)]
    assert four.decode_sparse(four.encode(x))[1].tolist() == want


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_error_feedback_is_exact(bits):
    """With levels a sent value's level is 0 or within a factor of two of it with its sign, so the accumulator less
    the decoded value is exact: residual + decoded == accumulator bit for bit, over fp32's range (subnormal to
    1e30); the messages are the reference's."""
    opts = _options("flat", "levels", 0.05, bits, 1000)
    numel = 5000
    mean = TopkMean(TensorCodec(numel, opts), 1, 0.9)
    for r in range(4):
        update = _heavy(numel, 100 + r) * 10.0 ** (4 * r - 30)
        if r == 3:
            update[::97] = 1.0e30
        acc = mean.residual * 0.9 + update
        message = mean.prepare(update)
        assert message.numpy().tobytes() == ref_encode(acc.numpy(), [(numel,)], **_reference(opts))
        sent, values = compress_all(acc.numpy(), [(numel,)], **_reference(opts))
        assert np.array_equal(mean.residual.numpy()[sent] + values, acc.numpy()[sent])
        rest = np.setdiff1d(np.arange(numel), sent)
        assert np.array_equal(mean.residual.numpy()[rest], acc.numpy()[rest]) and sent.size == 5 * 50


@pytest.mark.parametrize(
    "what, needle",
    [
        ("negative", "a scale that is negative or not finite"),
        ("nan", "a scale that is negative or not finite"),
        ("code", "a value code above 2 (2 bits)"),
        ("index", "indices out of range"),
    ],
)
def test_malformed_messages_are_refused(what, needle):
    codec = TensorCodec(4000, _options("flat", "levels", 0.02, 2, 1000))  # 4 chunks of 20 kept: 4 x 4 scale bytes
    message = codec.encode(_heavy(4000, 1)).clone()
    if what == "negative":
        message[4:8] = torch.tensor([-1.0]).view(torch.uint8)
    elif what == "nan":
        message[0:4] = torch.tensor([float("nan")]).view(torch.uint8)
    elif what == "code":
        message[-1] = 0xFF  # the last chunk's last codes: 3, a level that is never written
    else:
        message[16:19] = 0  # chunk 0's first two 10-bit indices both 0
    with pytest.raises(ValueError, match=re.escape(needle)):
        codec.decode(message)


@pytest.mark.parametrize("quantizer", ["levels", "bins"])
def test_the_hubs_codec_and_relay_read_what_the_facility_wrote(quantizer):
    """The hub's :class:`UpdateCodec` of flat chunks: the facility's bytes, also window by window (windows of whole
    runs of chunks), a decode stream equal to the decoded message, and the relay's fold, 777 values at a time,
    equal to the per-index mean over the senders computed here in float64 from the reference's decoding."""
    from helpers.sparseloco_reference import sender_mean

    opts = _options("flat", quantizer, 0.02, 2, 1000)
    numel = sum(int(np.prod(s)) for s in SHAPES)
    xs = [_heavy(numel, 20 + j) for j in range(2)]
    hub = UpdateCodec("topk", numel, 1000, opts, [list(s) for s in SHAPES])
    mine = TensorCodec(numel, opts, SHAPES)
    messages = [mine.encode(x) for x in xs]
    assert all(torch.equal(hub.encode(x), m) for x, m in zip(xs, messages))
    windows = TensorCodec(numel, _options("flat", quantizer, 0.02, 2, 4)).windows(10)
    assert len(windows) == -(-numel // ((1 << 20) // 4 * 4))  # runs of 2**18 chunks of 4 values
    assert torch.equal(torch.cat([hub.encode_window(xs[0][s : s + n], s) for s, n in hub.windows(1000)]), messages[0])
    stream = torch.cat([v for _, v in hub.decode_stream(io.BytesIO(messages[0].numpy().tobytes()).read)])
    assert torch.equal(stream, mine.decode(messages[0]))
    decoded = [ref_decode(m.numpy().tobytes(), SHAPES, **_reference(opts)) for m in messages]
    for scales in ([0.5, 0.5], [0.75, 0.25]):
        readers = [relay.Reader(io.BytesIO(m.numpy().tobytes()), hub) for m in messages]
        out = []
        for start in range(0, numel, 777):
            out.append(torch.empty(min(777, numel - start)))
            relay.fold(out[-1], readers, scales, "mean", 0.0)
        want = sender_mean([d for d, _ in decoded], [s for _, s in decoded], scales)
        assert np.abs(torch.cat(out).double().numpy() - want).max() <= 1e-6 * np.abs(want).max()
        one = TopkFold(torch.zeros(numel))
        for m, w in zip(messages, fold_weights(scales)):
            one.add(*mine.decode_sparse(m), w)
        assert torch.equal(torch.cat(out), one.finish())


# ----------------------------------------------------------------------------- configuration
def test_the_flat_preset_sets_its_choices_and_keeps_the_outer_rule():
    """``federation/topk=flat``: flat 4096-value chunks, levels, 2%, 2 bits, decay 0.95, error feedback; the outer
    rule is the experiment's (DiLoCo's Nesterov, under which it was measured)."""
    cfg = validated_federation(["+experiment=diloco", "federation/topk=flat"])
    t = cfg.topk
    assert (cfg.compression, cfg.feedback, cfg.chunk_size) == ("topk", True, 4096)
    assert (t.chunks, t.quantizer, t.density, t.bits, t.decay, t.preset) == ("flat", "levels", 0.02, 2, 0.95, "flat")
    assert (cfg.outer.name, cfg.outer.lr) == ("nesterov", 0.8)
    with pytest.raises(ValueError) as err:
        validated_federation(["federation/topk=flat", "federation.topk.density=0.03125"])
    line = str(err.value)
    assert "\n" not in line and line.startswith(
        "federation.topk.density=0.03125 contradicts federation/topk=flat, which sets it to 0.02"
    )
