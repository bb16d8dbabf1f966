"""Tests of the data layer (xffl_like.data): CPU only, a few seconds."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from helpers import REPO
from omegaconf import OmegaConf

from xffl_like.config.schema import DataConfig
from xffl_like.data import (
    DataSource,
    SyntheticMarkovSource,
    TextByteSource,
    build_data,
    decode,
    encode,
    resolve_paths,
    validate_data,
)

CONF = REPO / "conf" / "data"
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"
BLOCK = 64 * 1024


# --------------------------------------------------------------------------- helpers
def synth(non_iid=0.5, *, facility=0, rank=0, seed=0, seq_len=64, batch_size=4, vocab_size=256, num_eval_batches=2):
    cfg = DataConfig(name="synthetic", num_eval_batches=num_eval_batches, non_iid=non_iid)
    return build_data(
        cfg,
        vocab_size=vocab_size,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        facility=facility,
        num_facilities=3,
        facility_rank=rank,
        facility_size=2,
    )


def text_cfg(path, **kw):
    cfg = {"name": "text", "path": str(path), "partition": "contiguous", "eval_fraction": 0.1, "num_eval_batches": 2}
    cfg.update(kw)
    return DataConfig(**cfg)


def build_text(cfg, *, facility, num_facilities, rank, size, seq_len=32, batch_size=8, seed=0, base_dir=None):
    return build_data(
        cfg,
        vocab_size=256,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        facility=facility,
        num_facilities=num_facilities,
        facility_rank=rank,
        facility_size=size,
        base_dir=base_dir,
    )


def assert_shift(x, y, batch_size, seq_len, vocab_size):
    assert x.shape == y.shape == (batch_size, seq_len)
    assert x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < vocab_size
    assert int(y.min()) >= 0 and int(y.max()) < vocab_size


def unigram(src, steps):
    h = torch.zeros(src.vocab_size, dtype=torch.float64)
    for s in range(steps):
        h += torch.bincount(src.train_batch(s)[0].flatten(), minlength=src.vocab_size).double()
    return h / h.sum()


def bigram(src, steps):
    v = src.vocab_size
    h = torch.zeros(v * v, dtype=torch.float64)
    for s in range(steps):
        x, y = src.train_batch(s)
        h += torch.bincount((x * v + y).flatten(), minlength=v * v).double()
    return h / h.sum()


def tv(p, q):
    return 0.5 * float((p - q).abs().sum())


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    """~400 KB of pseudo-random UTF-8 text (with some multi-byte characters)."""
    rng = random.Random(1234)
    words = ["alpha", "beta", "gamma", "délta", "épsilon", "zeta", "ēta", "theta", "iota", "kappa", "λ", "mu"]
    lines = []
    size = 0
    while size < 400_000:
        line = " ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) + ".\n"
        lines.append(line)
        size += len(line.encode("utf-8"))
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("".join(lines), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- synthetic
def test_synthetic_shapes_range_and_protocol():
    for vocab in (256, 50):
        src = synth(vocab_size=vocab, seq_len=33, batch_size=5)
        assert isinstance(src, DataSource) and isinstance(src, SyntheticMarkovSource)
        x, y = src.train_batch(0)
        assert_shift(x, y, 5, 33, vocab)
        evals = src.eval_batches()
        assert len(evals) == 2
        for ex, ey in evals:
            assert_shift(ex, ey, 5, 33, vocab)


def test_synthetic_determinism():
    a, b = synth(seed=7, facility=1, rank=1), synth(seed=7, facility=1, rank=1)
    for step in (0, 1, 5, 1000):
        xa, ya = a.train_batch(step)
        xb, yb = b.train_batch(step)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert torch.equal(a.train_batch(3)[0], a.train_batch(3)[0])  # no hidden state
    assert not torch.equal(a.train_batch(0)[0], a.train_batch(1)[0])
    assert not torch.equal(a.train_batch(0)[0], synth(seed=7, facility=1, rank=0).train_batch(0)[0])
    assert not torch.equal(a.train_batch(0)[0], synth(seed=7, facility=0, rank=1).train_batch(0)[0])
    assert not torch.equal(a.train_batch(0)[0], synth(seed=8, facility=1, rank=1).train_batch(0)[0])
    ea, eb = a.eval_batches(), b.eval_batches()
    assert all(torch.equal(p[0], q[0]) and torch.equal(p[1], q[1]) for p, q in zip(ea, eb))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(ea, a.eval_batches()))
    # eval stream differs from the training stream (same seed, facility, rank)
    train = [a.train_batch(s)[0] for s in range(len(ea) + 4)]
    assert not any(torch.equal(ex, tx) for ex, _ in ea for tx in train)
    assert not torch.equal(ea[0][0], ea[1][0])


def test_synthetic_non_iid():
    # non_iid = 1: each facility its own chain -> clearly different statistics
    f0, f1 = synth(1.0, facility=0, seq_len=256, batch_size=8), synth(1.0, facility=1, seq_len=256, batch_size=8)
    assert tv(unigram(f0, 12), unigram(f1, 12)) > 0.5
    assert tv(bigram(f0, 12), bigram(f1, 12)) > 0.8
    assert tv(f0.transition_matrix().flatten() / 256, f1.transition_matrix().flatten() / 256) > 0.8
    # non_iid = 0: one shared chain -> equal in distribution, different samples
    g0, g1 = synth(0.0, facility=0, seq_len=256, batch_size=8), synth(0.0, facility=1, seq_len=256, batch_size=8)
    assert torch.equal(g0.transition_matrix(), g1.transition_matrix())
    assert not torch.equal(g0.train_batch(0)[0], g1.train_batch(0)[0])
    assert tv(unigram(g0, 12), unigram(g1, 12)) < 0.1
    # in between: in between
    h0, h1 = synth(0.5, facility=0, seq_len=256, batch_size=8), synth(0.5, facility=1, seq_len=256, batch_size=8)
    mid = tv(h0.transition_matrix().flatten() / 256, h1.transition_matrix().flatten() / 256)
    assert 0.2 < mid < 0.8
    # ranks of one facility share the distribution
    r0, r1 = (
        synth(1.0, facility=2, rank=0, seq_len=256, batch_size=8),
        synth(1.0, facility=2, rank=1, seq_len=256, batch_size=8),
    )
    assert tv(unigram(r0, 12), unigram(r1, 12)) < 0.1


def test_synthetic_learnable_by_bigram_model():
    torch.manual_seed(0)
    vocab = 256
    src = synth(0.5, facility=1, seq_len=128, batch_size=8)
    model = torch.nn.Embedding(vocab, vocab)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def eval_loss():
        with torch.no_grad():
            losses = [
                torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in src.eval_batches()
            ]
        return float(sum(losses) / len(losses))

    start = eval_loss()
    assert start > 0.8 * math.log(vocab)
    for step in range(200):
        x, y = src.train_batch(step)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = eval_loss()
    assert end < 0.5 * math.log(vocab), (start, end)


# --------------------------------------------------------------------------- text: expected layout,
# computed independently
def expected_owner(n_bytes, seq_len, eval_fraction, num_facilities, size, partition):
    """owner[i] = f * size + r for training bytes, -1 for the held-out tail."""
    n_eval = max(int(n_bytes * eval_fraction), seq_len + 1)
    n_train = n_bytes - n_eval
    pos = torch.arange(n_train)
    if partition == "contiguous":
        fac = torch.empty(n_train, dtype=torch.long)
        for f in range(num_facilities):
            fac[f * n_train // num_facilities : (f + 1) * n_train // num_facilities] = f
    else:
        fac = (pos // BLOCK) % num_facilities
    owner = torch.full((n_bytes,), -1, dtype=torch.long)
    for f in range(num_facilities):
        idx = pos[fac == f]  # this facility's bytes in corpus order
        for r in range(size):
            owner[idx[r * len(idx) // size : (r + 1) * len(idx) // size]] = f * size + r
    return owner, n_train, n_eval


@pytest.mark.parametrize("partition", ["contiguous", "interleaved"])
@pytest.mark.parametrize("num_facilities,size", [(2, 2), (3, 1), (1, 3)])
def test_text_slices_disjoint_and_batches_from_own_slice(corpus_file, partition, num_facilities, size):
    seq_len, batch_size = 32, 16
    data = corpus_file.read_bytes()
    corpus = torch.tensor(list(data), dtype=torch.long)
    owner, n_train, n_eval = expected_owner(len(data), seq_len, 0.1, num_facilities, size, partition)
    cfg = text_cfg(corpus_file, partition=partition)
    arange = torch.arange(seq_len + 1)
    covered = torch.zeros(len(data), dtype=torch.long)
    eval_segments = []
    for f in range(num_facilities):
        for r in range(size):
            src = build_text(
                cfg,
                facility=f,
                num_facilities=num_facilities,
                rank=r,
                size=size,
                seq_len=seq_len,
                batch_size=batch_size,
            )
            assert isinstance(src, TextByteSource) and isinstance(src, DataSource)
            assert (src.n_train, src.n_eval) == (n_train, n_eval)
            me = f * size + r
            for a, b in src.train_segments:  # reported slices == expected ownership
                assert bool((owner[a:b] == me).all())
                covered[a:b] += 1
            assert sum(b - a for a, b in src.train_segments) == int((owner == me).sum())
            for step in range(6):
                offs = src.window_offsets(step)
                x, y = src.train_batch(step)
                assert_shift(x, y, batch_size, seq_len, 256)
                idx = offs[:, None] + arange
                assert bool((owner[idx] == me).all()), "window outside the rank's own slice"
                assert torch.equal(x, corpus[idx[:, :-1]]) and torch.equal(y, corpus[idx[:, 1:]])
            eval_segments.append(src.eval_segment)
            evals = src.eval_batches()
            assert len(evals) == 2
            eoffs = src.eval_offsets().view(2, batch_size)
            for (ex, ey), eo in zip(evals, eoffs):
                assert_shift(ex, ey, batch_size, seq_len, 256)
                eidx = eo[:, None] + arange
                assert bool((owner[eidx] == -1).all()), "eval window outside the held-out tail"
                lo, hi = src.eval_segment
                assert int(eidx.min()) >= lo and int(eidx.max()) < hi
                assert torch.equal(ex, corpus[eidx[:, :-1]]) and torch.equal(ey, corpus[eidx[:, 1:]])
    # every training byte owned exactly once, nothing of the tail
    assert bool((covered[:n_train] == 1).all()) and bool((covered[n_train:] == 0).all())
    # eval slices: disjoint across ranks (tail is large enough here), same for every facility
    per_rank = eval_segments[:size]
    assert eval_segments == per_rank * num_facilities
    for i in range(size):
        for j in range(i + 1, size):
            (a0, b0), (a1, b1) = per_rank[i], per_rank[j]
            assert b0 <= a1 or b1 <= a0
    assert min(a for a, _ in per_rank) == n_train and max(b for _, b in per_rank) == len(data)


def test_text_determinism(corpus_file):
    cfg = text_cfg(corpus_file, partition="interleaved")
    a = build_text(cfg, facility=1, num_facilities=2, rank=1, size=2, seed=3)
    b = build_text(cfg, facility=1, num_facilities=2, rank=1, size=2, seed=3)
    for step in (0, 1, 77):
        assert torch.equal(a.train_batch(step)[0], b.train_batch(step)[0])
        assert torch.equal(a.train_batch(step)[1], b.train_batch(step)[1])
    assert not torch.equal(a.train_batch(0)[0], a.train_batch(1)[0])
    c = build_text(cfg, facility=1, num_facilities=2, rank=1, size=2, seed=4)
    assert not torch.equal(a.train_batch(0)[0], c.train_batch(0)[0])
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a.eval_batches(), b.eval_batches()))
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a.eval_batches(), a.eval_batches()))


def test_text_small_tail_is_shared(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("to be or not to be, that is the question. " * 60, encoding="utf-8")  # ~2.6 KB
    n = path.stat().st_size
    seq_len = 100  # tail = 258 bytes < 4 ranks * 101
    srcs = [
        build_text(text_cfg(path), facility=0, num_facilities=1, rank=r, size=4, seq_len=seq_len, batch_size=2)
        for r in range(4)
    ]
    assert all(not s.eval_disjoint for s in srcs)
    assert all(s.eval_segment == (n - max(int(n * 0.1), seq_len + 1), n) for s in srcs)
    for s in srcs[1:]:
        assert all(torch.equal(p[0], q[0]) for p, q in zip(srcs[0].eval_batches(), s.eval_batches()))
    # too many ranks for the training part -> clear error naming data.path
    with pytest.raises(ValueError, match=r"^data\.path: .*rank"):
        build_text(text_cfg(path), facility=0, num_facilities=1, rank=0, size=200, seq_len=seq_len, batch_size=2)


def test_text_list_of_files_and_relative_paths(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("a" * 3000, encoding="utf-8")
    (tmp_path / "b.txt").write_text("b" * 1000, encoding="utf-8")
    cfg = DataConfig(
        name="text", path=["sub/a.txt", "b.txt"], partition="contiguous", eval_fraction=0.25, num_eval_batches=1
    )
    paths = resolve_paths(cfg, tmp_path)
    assert paths == [tmp_path / "sub" / "a.txt", tmp_path / "b.txt"]
    assert resolve_paths(DataConfig(path=str(tmp_path / "b.txt")), "/nonexistent") == [tmp_path / "b.txt"]
    validate_data(cfg, vocab_size=256, seq_len=16, base_dir=tmp_path)
    src = build_text(cfg, facility=0, num_facilities=1, rank=0, size=1, seq_len=16, base_dir=tmp_path)
    ((ex, ey),) = src.eval_batches()
    assert decode(ex[0]) == "b" * 16  # the tail (last 1000 bytes) is the second file
    assert set(decode(src.train_batch(0)[0].flatten())) == {"a"}


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="tinyshakespeare.txt not available")
def test_text_tinyshakespeare_with_yaml_config():
    cfg = DataConfig(**OmegaConf.to_container(OmegaConf.load(CONF / "text.yaml")))
    assert cfg.path == "../shared/data/tinyshakespeare.txt"
    validate_data(cfg, vocab_size=256, seq_len=128, base_dir=REPO)
    n = SHAKESPEARE.stat().st_size
    n_eval = int(n * 0.1)
    for partition in ("contiguous", "interleaved"):
        cfg = replace(cfg, partition=partition)
        srcs = [
            build_text(cfg, facility=f, num_facilities=2, rank=r, size=2, seq_len=128, batch_size=8, base_dir=REPO)
            for f in range(2)
            for r in range(2)
        ]
        segs = sorted(seg for s in srcs for seg in s.train_segments)
        assert segs[0][0] == 0 and segs[-1][1] == n - n_eval
        assert all(b0 <= a1 for (_, b0), (a1, _) in zip(segs, segs[1:]))
        for s in srcs:
            x, y = s.train_batch(0)
            assert_shift(x, y, 8, 128, 256)
            assert int((s.window_offsets(0) + 129).max()) <= n - n_eval
            assert all(int(o) >= n - n_eval for o in s.eval_offsets())
            decode(x[0])  # plain text
    assert sum(ch.isalpha() for ch in decode(srcs[0].train_batch(0)[0].flatten())) > 500


def test_encode_decode_roundtrip():
    s = "Hello, wörld — ünïcödé ✓\n"
    t = encode(s)
    assert t.dtype == torch.long and t.numel() == len(s.encode("utf-8"))
    assert int(t.max()) < 256 and int(t.min()) >= 0
    assert decode(t) == s and decode(t.tolist()) == s
    assert encode("").numel() == 0 and decode([]) == ""


# --------------------------------------------------------------------------- validation
def test_validate_yaml_defaults():
    for name in ("synthetic", "text"):
        cfg = OmegaConf.load(CONF / f"{name}.yaml")
        assert cfg.name == name and cfg.num_eval_batches == 4
    validate_data(
        DataConfig(**OmegaConf.to_container(OmegaConf.load(CONF / "synthetic.yaml"))), vocab_size=256, seq_len=128
    )
    validate_data(DataConfig(name="synthetic", num_eval_batches=1, non_iid=0), vocab_size=32, seq_len=8)


def _err(cfg, *, vocab_size=256, seq_len=32, base_dir=None):
    with pytest.raises(ValueError) as info:
        validate_data(cfg, vocab_size=vocab_size, seq_len=seq_len, base_dir=base_dir)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


def test_validate_errors(tmp_path, corpus_file):
    good = text_cfg(corpus_file)
    validate_data(good, vocab_size=256, seq_len=32)

    msg = _err(DataConfig(name="images"))
    assert msg.startswith("data.name:") and "'images'" in msg and "data.name=synthetic" in msg

    missing = tmp_path / "nope" / "missing.txt"
    msg = _err(text_cfg("nope/missing.txt"), base_dir=tmp_path)
    assert msg == f"data.path: file not found: {missing} (pass data.path=<existing UTF-8 text file>)"

    (tmp_path / "empty.txt").write_bytes(b"")
    assert _err(text_cfg(tmp_path / "empty.txt")).startswith("data.path: file is empty:")

    (tmp_path / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 200)
    msg = _err(text_cfg(tmp_path / "latin1.txt"))
    assert msg.startswith("data.path: file is not valid UTF-8")

    assert _err(text_cfg(tmp_path)).startswith("data.path: not a regular file")

    (tmp_path / "short.txt").write_text("x" * 100, encoding="utf-8")
    msg = _err(text_cfg(tmp_path / "short.txt"), seq_len=64)
    assert msg.startswith("data.path:") and "too short" in msg and "seq_len=64" in msg
    validate_data(text_cfg(tmp_path / "short.txt"), vocab_size=256, seq_len=40)  # 100 - 41 >= 41

    assert _err(good, vocab_size=128).startswith("vocab_size:")
    for bad in (0, -1, 1.5, "4", None):
        assert _err(replace(good, num_eval_batches=bad)).startswith("data.num_eval_batches:")
        assert _err(DataConfig(name="synthetic", num_eval_batches=bad, non_iid=0.5)).startswith(
            "data.num_eval_batches:"
        )
    for bad in (0, 1, 1.5, -0.1, "0.1", float("nan")):
        assert _err(replace(good, eval_fraction=bad)).startswith("data.eval_fraction:")
    assert _err(replace(good, partition="random")).startswith("data.partition:")
    assert _err(replace(good, path=[])).startswith("data.path:")
    for bad in (-0.1, 1.01, "high", None):
        assert _err(DataConfig(name="synthetic", num_eval_batches=4, non_iid=bad)).startswith("data.non_iid:")
    assert _err(DataConfig(name="synthetic", num_eval_batches=4, non_iid=0.5), seq_len=0).startswith("seq_len:")


def test_build_checks_layout():
    with pytest.raises(ValueError, match=r"^facility_rank:"):
        synth(rank=2)
    with pytest.raises(ValueError, match=r"^facility:"):
        synth(facility=3)
    with pytest.raises(ValueError, match=r"^data\.name:"):
        build_data(
            DataConfig(name="x"),
            vocab_size=256,
            seq_len=8,
            batch_size=1,
            seed=0,
            facility=0,
            num_facilities=1,
            facility_rank=0,
            facility_size=1,
        )
