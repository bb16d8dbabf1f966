"""Real tokenizers, ``prepare`` and ``data=tokens``: a BPE tokenizer trained here on tinyshakespeare
(the ``tokenizers`` trainer, nothing downloaded), the token file checked against the tokenizer
itself, each rank's windows checked against its slice computed by hand, a job that learns, and the
bad inputs that must stop before any worker starts."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

tokenizers = pytest.importorskip("tokenizers")

from helpers import REPO, run_cli  # noqa: E402

from xffl_like.config.schema import DataConfig  # noqa: E402
from xffl_like.config.validate import ConfigError, validate_config  # noqa: E402
from xffl_like.data import build_data  # noqa: E402
from xffl_like.data.prepare import main as prepare_main  # noqa: E402
from xffl_like.job import _compose, resolve  # noqa: E402

VOCAB = 512


def _corpus() -> Path:
    for base in (os.environ.get("XFFL_SHARED"), REPO.parent / "shared", "/work/shared"):
        if base and (Path(base) / "data" / "tinyshakespeare.txt").exists():
            return Path(base) / "data" / "tinyshakespeare.txt"
    pytest.skip("tinyshakespeare.txt not found (set XFFL_SHARED to the shared folder)")


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """(BPE tokenizer.json, two document files, prepared directory)."""
    root = tmp_path_factory.mktemp("tokens")
    text = _corpus().read_text(encoding="utf-8")
    docs = [root / "part1.txt", root / "part2.txt"]
    half = len(text) // 2
    docs[0].write_text(text[:half], encoding="utf-8")
    docs[1].write_text(text[half:], encoding="utf-8")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train([str(p) for p in docs], trainer)
    tok.save(str(root / "tokenizer.json"))
    out = root / "prepared"
    assert prepare_main(["--tokenizer", str(root / "tokenizer.json"), "--output", str(out), *map(str, docs)]) == 0
    return root / "tokenizer.json", docs, out


def test_prepare_writes_the_tokenizers_ids_with_eos_between_documents(prepared):
    tokenizer, docs, out = prepared
    tok = tokenizers.Tokenizer.from_file(str(tokenizer))
    eos = tok.token_to_id("<|endoftext|>")
    expected = []
    for doc in docs:
        expected += tok.encode(doc.read_text(encoding="utf-8"), add_special_tokens=False).ids + [eos]
    meta = json.loads((out / "meta.json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size() and meta["eos_id"] == eos
    assert meta["num_tokens"] == len(expected)
    assert meta["document_starts"] == [0, expected.index(eos) + 1]
    assert np.fromfile(out / "tokens.bin", dtype=np.uint16).tolist() == expected


def test_prepare_byte_tokenizer(tmp_path):
    (tmp_path / "a.txt").write_text("héllo", encoding="utf-8")
    (tmp_path / "b.jsonl").write_text('{"text": "ab"}\n{"text": "c"}\n', encoding="utf-8")
    assert (
        prepare_main(
            ["--tokenizer", "byte", "--output", str(tmp_path / "o"), str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
        )
        == 0
    )
    want = list("héllo".encode()) + [0] + [97, 98, 0, 99, 0]
    assert np.fromfile(tmp_path / "o" / "tokens.bin", dtype=np.uint16).tolist() == want
    assert json.loads((tmp_path / "o" / "meta.json").read_text())["document_starts"] == [0, 7, 10]


def test_each_rank_reads_windows_of_its_own_contiguous_block(prepared):
    _, _, out = prepared
    tokens = np.fromfile(out / "tokens.bin", dtype=np.uint16).astype(np.int64)
    n = len(tokens)
    n_train = n - max(int(n * 0.1), 65)  # eval_fraction 0.1, seq_len 64
    cfg = {"name": "tokens", "path": str(out), "partition": "contiguous", "eval_fraction": 0.1, "num_eval_batches": 2}
    for facility in range(2):
        block = (facility * n_train // 2, (facility + 1) * n_train // 2)  # non-IID: contiguous facility blocks
        for rank in range(2):
            lo = block[0] + rank * (block[1] - block[0]) // 2
            hi = block[0] + (rank + 1) * (block[1] - block[0]) // 2
            source = build_data(
                DataConfig(**cfg),
                vocab_size=VOCAB,
                seq_len=64,
                batch_size=8,
                seed=0,
                facility=facility,
                num_facilities=2,
                facility_rank=rank,
                facility_size=2,
            )
            for step in range(3):
                x, y = source.train_batch(step)
                for row_x, row_y in zip(x, y):
                    start = _find(tokens, row_x.numpy(), lo, hi)
                    assert lo <= start and start + 65 <= hi, (facility, rank, start, lo, hi)
                    assert torch.equal(row_y, torch.from_numpy(tokens[start + 1 : start + 65]))
            for ex, _ in source.eval_batches():
                assert _find(tokens, ex[0].numpy(), n_train, n) >= n_train  # the held-out tail


def _find(tokens, window, lo, hi):
    """Offset of ``window`` in ``tokens`` searched in [lo - 1000, hi + 1000) (must exist)."""
    a, b = max(lo - 1000, 0), min(hi + 1000, len(tokens))
    view = np.lib.stride_tricks.sliding_window_view(tokens[a:b], len(window))
    hits = np.flatnonzero((view == window).all(axis=1))
    assert len(hits), "window not found near the rank's block"
    return a + int(hits[0])


@pytest.mark.cli
@pytest.mark.slow
def test_job_learns_on_bpe_tokens(prepared, tmp_path):
    _, _, out = prepared
    proc, _ = run_cli(
        [
            "+experiment=llama_fed",
            "data=tokens",
            f"data.path={out}",
            f"model.vocab_size={VOCAB}",
            "distributed.nproc_per_node=2",  # two facilities of one process: what is learnt is the point, not
            "distributed.federated=1",  # the layout (test_hf exports from FSDP shards), at half the CPU per step
            "train.steps=40",
            "federation.every=10",
            "train.seq_len=64",
            "train.batch_size=8",
            "train.log_every=10",
            "logger=none",
            "export.hf=true",
            "data.num_eval_batches=1",  # the test reads the training loss
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["first_loss"] > 5.5  # ~ln(512) at the start
    assert summary["final_loss"] < summary["first_loss"] - 1.5, summary["facility_losses"]
    # The export carries the tokenizer that prepare recorded, with its EOS, for transformers.
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    reference = tokenizers.Tokenizer.from_file(str(prepared[0]))
    assert tok("To be, or not")["input_ids"] == reference.encode("To be, or not", add_special_tokens=False).ids
    assert tok.eos_token_id == reference.token_to_id("<|endoftext|>")


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory, prepared):
    root = tmp_path_factory.mktemp("bad")
    (root / "bin").mkdir()
    (root / "bin" / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 4,
                "vocab_size": 300,
                "intermediate_size": 96,
            }
        )
    )
    (root / "bin" / "pytorch_model.bin").write_bytes(b"not loaded")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "config.json").write_text((root / "bin" / "config.json").read_text())
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 16)
    (root / "short").mkdir()
    (root / "short" / "a.txt").write_text("to be or not to be " * 40)
    assert prepare_main(["--output", str(root / "short" / "out"), str(root / "short" / "a.txt")]) == 0
    (root / "truncated").mkdir()
    for name in ("meta.json", "tokens.bin"):
        (root / "truncated" / name).write_bytes(
            (prepared[2] / name).read_bytes()[: 10**9 if name == "meta.json" else 100]
        )
    return root


BAD_FILES = [
    (["model=hf", "model.path={root}/bin"], "pickle weights (*.bin)"),
    (["model=hf", "model.path={root}/corrupt"], "not a readable safetensors file"),
    (["model=hf", "model.path={root}/nowhere"], "not a directory"),
    (["data=tokens", "data.path={prepared}"], "model.vocab_size=256 is smaller than the vocabulary"),
    (["data=tokens", "data.path={root}/short/out", "train.seq_len=64"], "fewer than train.batch_size=8"),
    (["data=tokens", "data.path={root}/truncated", "model.vocab_size=512"], "tokens.bin is 100 bytes"),
    (["data=tokens", "data.path={root}"], "no meta.json"),
    (["data=text", "data.tokenizer={root}/no_tokenizer.json"], "no tokenizer.json"),
    (["data=text", "data.tokenizer={tokenizer}"], "smaller than the vocabulary of data.tokenizer"),
]


@pytest.mark.parametrize("overrides, needle", BAD_FILES, ids=[b[1][:30] for b in BAD_FILES])
def test_bad_files_are_refused_by_validation(bad_dirs, prepared, overrides, needle):
    """In the launching process (fast): one line naming the problem."""
    where = {"root": bad_dirs, "prepared": prepared[2], "tokenizer": prepared[0]}
    plain = resolve(_compose(["+experiment=llama_fed", *[o.format(**where) for o in overrides]]))
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        validate_config(plain, 4, 4, REPO)
    assert "\n" not in str(info.value)
    print(info.value)


@pytest.mark.cli
@pytest.mark.parametrize("overrides, needle", [BAD_FILES[0], BAD_FILES[4]], ids=["bin", "short"])
def test_bad_files_fail_before_launch(bad_dirs, prepared, overrides, needle, tmp_path):
    """The CLI: exit code, one line, no traceback, nothing written (a pickle dir, a corpus too short)."""
    where = {"root": bad_dirs, "prepared": prepared[2], "tokenizer": prepared[0]}
    proc, _ = run_cli(["+experiment=llama_fed", *[o.format(**where) for o in overrides]], tmp_path / "run", timeout=60)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr
    assert proc.stderr.count("error:") == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "run" / "config.yaml").exists()  # stopped before anything was written or launched
