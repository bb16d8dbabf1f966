"""Issue 19, classes 1 and 8: values that used to pass validation and then hang or crash in the workers,
and inputs that are not what they claim (devices, /proc files, directories, a corrupt meta.json, shape
keys beside model.path, paths Hydra cannot parse). Every case is refused by the launcher before any
worker starts: exit code 2, one line ``error: ...`` naming the key and the fix, no traceback.

All command lines run in one process (``workers.cli_batch``); ``prepare`` runs in this process, and once
as ``python -m`` (the runpy warning only shows there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import PYTHONPATH, REPO

from xffl_like.data.prepare import main as prepare_main

pytestmark = pytest.mark.cli

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_NCCL = (
    "needs CUDA GPUs, and torch sees none" if _GPUS == 0 else "needs one GPU per process" if _GPUS < 4 else None
)  # llama_fed: 4 processes

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "vocab_size": 300,
    "intermediate_size": 96,
}
META = {
    "format": "xffl_like.tokens/1",
    "tokenizer": "byte",
    "vocab_size": 256,
    "eos_id": 0,
    "dtype": "uint16",
    "num_tokens": 4,
    "files": [],
    "document_starts": [0],
}

# (overrides, the phrase the one line must hold); {root}: a folder of prepared inputs (see `root`).
BAD = [
    # class 1: a bound derived from what the value depends on
    (["strategy.streams=500"], "strategy.streams=500: at most 16"),
    (
        ["parallel=decentralized", "train.dtype=bfloat16"],
        "train.dtype=bfloat16 with parallel=decentralized: the full copies train in float32",
    ),
    (["optim.warmup_steps=1000", "train.steps=4"], "optim.warmup_steps=1000 exceeds train.steps=4"),
    (["distributed.timeout_s=999999999999"], "distributed.timeout_s=999999999999: at most 604800"),
    (["seed=18446744073709551616"], "seed=18446744073709551616: must be in [-2**63, 2**64)"),
    (["export.max_shard_mb=inf"], "export.max_shard_mb=inf: must be a positive number"),
    (["strategy.bucket_mb=inf"], "strategy.bucket_mb=inf: need a positive number"),
    (["parallel=decentralized", "parallel.bucket_mb=inf"], "parallel.bucket_mb=inf: must be a positive number"),
    (["model.max_seq_len=100000000"], "model.max_seq_len=100000000: its RoPE tables would take"),
    (
        ["data=text", "data.path={root}/corpus.txt", "data.num_eval_batches=100000000"],
        "data.num_eval_batches=100000000: 800,000,000 held-out windows per rank",
    ),
    *([(["distributed.backend=nccl"], f"distributed.backend=nccl {_NCCL}")] if _NCCL else []),
    # issue 29: the delayed outer step
    (["federation.delay=2"], "federation.delay=2: use 0 (each round's outer step at its boundary) or 1"),
    (["federation.algorithm=synchronous", "federation.delay=1"], "so federation.delay does not apply"),
    (["federation.delay_rule=own_full"], "federation.delay_rule=own_full applies to federation.delay=1 (now 0)"),
    (
        [
            "federation.elastic.hub=127.0.0.1:9",
            "distributed.federated=null",
            "federation.delay=1",
            "federation.every=null",
            "federation.every_s=5",
        ],
        "federation.delay=1 with federation.every_s through federation.elastic.hub: ",
    ),
    # issue 21: facilities of different speeds (llama_fed: 2 facilities, 60 steps, federation.every=10)
    (["federation.every=[4,2,2]"], "federation.every=[4, 2, 2]: 3 entries for 2 facilities"),
    (["federation.every=[4,0]"], "federation.every=[4, 0]: entry 0 is not a positive integer"),
    (["federation.every=[4,-2]"], "entry -2 is not a positive integer"),
    (["federation.every=[8,4]"], "with train.steps=60: the rounds must be whole for the facility with the most"),
    (
        ["federation.every_s=30"],
        "federation.every_s=30.0 with federation.every=10: a round ends by time or after a "
        "number of steps, not both; set federation.every=null",
    ),
    (["federation.every=null", "federation.every_s=0"], "federation.every_s=0.0: must be a number of seconds"),
    (["federation.every=null"], "federation.every=null: give the local steps per round"),
    (["federation.every=[6,3]", "train.eval_every=6"], "train.eval_every=6 evaluates at steps the facilities reach"),
    (["federation.every=[6,3]", "federation=diloco", "federation.fragments=2"], "fragments / overlap_steps stagger"),
    (
        ["federation.every=null", "federation.every_s=5", "federation.algorithm=synchronous"],
        "algorithm=synchronous averages gradients at every step",
    ),
    (["federation.every=[6,3]", "optim.warmup_steps=40"], "optim.warmup_steps=40 exceeds its fewest steps=30"),
    (["fault.slow_facility=1", "fault.slow_factor=0.5"], "fault.slow_factor=0.5: must be a number in [1, 1000]"),
    (["fault.slow_facility=2", "fault.slow_factor=2"], "fault.slow_facility=2: must be a facility of this job, 0..1"),
    (["fault.slow_factor=2"], "fault.slow_factor=2.0 slows no facility: set fault.slow_facility too"),
    # class 8: inputs that are not what they claim
    (["data=text", "data.path=/dev/zero"], "data.path: not a regular file: /dev/zero is a character device"),
    (["data=text", "data.path=/proc/self/status"], "/proc/self/status is a file of the kernel's /proc filesystem"),
    (["data=text", "data.path={root}"], "is a directory"),
    (
        ["data=text", "data.tokenizer=/dev/zero"],
        "data.tokenizer=/dev/zero: /dev/zero is not a regular file (a character device)",
    ),
    (
        ["data=text", "data.tokenizer=/proc/self/status"],
        "is not a regular file (a file of the kernel's /proc filesystem)",
    ),
    (["data=tokens", "data.path={root}/negative"], "meta.json has vocab_size=-5, not a positive integer"),
    (["data=tokens", "data.path={root}/fraction"], "meta.json has vocab_size=256.5, not a positive integer"),
    (["data=tokens", "data.path={root}/device"], "meta.json is not a regular file (a character device"),
    (
        ["data=tokens", "data.path={root}/corpus.txt"],
        "--output {root}/corpus-tokens {root}/corpus.txt, then data.path={root}/corpus-tokens",
    ),
    (["model=hf", "model.path={root}/hf_device"], "config.json is not a regular file (a character device)"),
    (["model=hf", "model.path={root}/hf", "model.dim=256"], "model.dim=256 set together with model.path={root}/hf"),
    (["model.path={root}/hf"], "model.dim=128, model.n_layers=4"),  # llama_tiny's shape beside a HF directory
    (
        ["data=text", "data.path={root}/a b/é.txt"],
        "quote the value for Hydra and the argument for the shell: \"data.path='{root}/a b/é.txt'\"",
    ),
    (["data=text", "data.path={root}/a(b).txt"], "\"data.path='{root}/a(b).txt'\""),
    (
        ["data=text", "data.path={root}/my", "file.txt"],
        "'file.txt' is not key=value: a value with spaces was split by the shell",
    ),
    # the quoting the hint gives works: the path reaches validation (a file too short to train on)
    (["data=text", "data.path='{root}/a b/é.txt'"], "data.path: corpus {root}/a b/é.txt has 6 bytes"),
    # issue 29: top-k with low-bit values and error feedback
    (
        ["federation.compression=topk", "federation.error_feedback=true", "federation.topk.density=0"],
        "federation.topk.density=0.0: must be a number in (0, 1]",
    ),
    (
        ["federation.compression=topk", "federation.error_feedback=true", "federation.topk.density=1.5"],
        "federation.topk.density=1.5: must be a number in (0, 1]",
    ),
    (
        ["federation.compression=topk", "federation.error_feedback=true", "federation.topk.bits=3"],
        "federation.topk.bits=3: use 2, 4 or 8",
    ),
    (
        ["federation.compression=topk", "federation.error_feedback=false"],
        "federation.error_feedback=false with federation.compression=topk: top-k without its accumulator",
    ),
    # issue 39: SparseLoCo's choices (a preset and a contradicting key; tiles that do not divide)
    (
        ["federation/topk=sparseloco", "federation.topk.decay=0.9"],
        "federation.topk.decay=0.9 contradicts federation/topk=sparseloco, which sets it to 0.95",
    ),
    (
        ["federation.compression=topk", "federation.topk.tile=12"],
        "federation.topk.density=0.03125 x tile^2 (12x12) is not a whole number of values",
    ),
    (
        ["federation.compression=topk", "federation.error_feedback=true", "federation.topology=ring"],
        "federation.topology=ring with federation.compression=topk: compressed gossip is not supported",
    ),
]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    (root / "corpus.txt").write_text("to be or not to be, that is the question. " * 200)
    (root / "a b").mkdir()
    (root / "a b" / "é.txt").write_text("hello\n")
    for name, vocab in (("negative", -5), ("fraction", 256.5)):
        (root / name).mkdir()
        (root / name / "meta.json").write_text(json.dumps({**META, "vocab_size": vocab}))
        (root / name / "tokens.bin").write_bytes(b"\0" * 8)
    (root / "device").mkdir()
    (root / "device" / "meta.json").symlink_to("/dev/zero")
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text(json.dumps(HF_CONFIG))
    (root / "hf_device").mkdir()
    (root / "hf_device" / "config.json").symlink_to("/dev/zero")
    return root


@pytest.fixture(scope="module")
def results(root):
    cases = [
        {
            "args": ["+experiment=llama_fed", *[a.format(root=root) for a in overrides]],
            "run_dir": str(root / "runs" / str(i)),
        }
        for i, (overrides, _) in enumerate(BAD)
    ]
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": PYTHONPATH}
    cmd = [sys.executable, "-m", "workers.cli_batch", str(root / "cases.json"), str(root / "results.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60 + 10 * len(BAD))
    assert proc.returncode == 0, proc.stderr
    return json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("index", range(len(BAD)), ids=[" ".join(b[0])[-40:] for b in BAD])
def test_refused_before_launch_in_one_line(index, results, root):
    needle = BAD[index][1].format(root=root)
    result = results[index]
    assert result["rc"] == 2, result
    assert "Traceback" not in result["stderr"] + result["stdout"]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result["stderr"]
    assert needle in lines[0], lines[0]
    assert not (root / "runs" / str(index) / "config.yaml").exists()  # nothing launched


PREPARE_BAD = [
    (["{root}/empty.txt"], "{root}/empty.txt: the file is empty, nothing to tokenize"),
    (["{root}/blank.txt"], "{root}/blank.txt: no text to tokenize"),
    (["{root}/none.jsonl"], "{root}/none.jsonl: no text to tokenize"),
    (["/dev/zero"], "/dev/zero: not a regular file (a character device)"),
    (["/proc/self/status"], "/proc/self/status: not a regular file (a file of the kernel's /proc filesystem)"),
    (["{root}"], "not a regular file (a directory)"),
    (
        ["--output", "{root}/text.txt", "{root}/text.txt"],
        "--output {root}/text.txt: would overwrite the input {root}/text.txt; write the corpus to another directory, "
        "e.g. --output {root}/text-tokens",
    ),
    (["--output", "{root}/inside", "{root}/inside/tokens.bin"], "would overwrite the input {root}/inside/tokens.bin"),
    (["--output", "{root}/other.txt", "{root}/text.txt"], "--output {root}/other.txt: exists and is not a directory"),
]


@pytest.fixture
def prepare_root(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text(" \n\n")
    (tmp_path / "none.jsonl").write_text("\n")
    (tmp_path / "text.txt").write_text("some text\n")
    (tmp_path / "other.txt").write_text("other\n")
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "tokens.bin").write_text("text named like the output\n")
    return tmp_path


@pytest.mark.parametrize("args, needle", PREPARE_BAD, ids=[p[1][:40] for p in PREPARE_BAD])
def test_prepare_refuses(prepare_root, args, needle, capsys):
    args = [a.format(root=prepare_root) for a in args]
    if "--output" not in args:
        args = ["--output", str(prepare_root / "out"), *args]
    before = {p: p.read_bytes() for p in prepare_root.rglob("*") if p.is_file()}
    assert prepare_main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("tokenizing")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle.format(root=prepare_root) in lines[0], err
    assert {p: p.read_bytes() for p in before} == before  # no input rewritten
    assert not (prepare_root / "out" / "tokens.bin").exists()


def test_prepare_as_a_module_prints_no_runpy_warning(tmp_path):
    (tmp_path / "a.txt").write_text("some text\n")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    cmd = [sys.executable, "-m", "xffl_like.data.prepare", "--output", str(tmp_path / "out"), str(tmp_path / "a.txt")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert (tmp_path / "out" / "tokens.bin").stat().st_size == 11 * 2  # 10 bytes and the EOS, uint16
