"""Tier 3: the CLI in a subprocess: the main job, the HSDP layout, text data, torchrun, bad inputs.

Every job that trains checks the aggregation's values, not only that copies agree: with
``XFFL_TEST_DUMP_ROUNDS`` its ranks record their shards around each round, and
``helpers/round_values.py`` recomputes the weighted mean of the facilities from them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import CORPUS, PYTHONPATH, REPO, TINY, run_cli, run_recorded
from helpers.round_values import check_round_values

pytestmark = pytest.mark.cli


def check_values(tmp_path, summary, weights):
    """The job's rounds were the weighted mean of its facilities (see ``helpers/round_values.py``)."""
    assert all(b > 0 for b in summary["aggregation_bytes_per_rank"]), summary["aggregation_bytes_per_rank"]
    check_round_values(tmp_path / "rounds", weights, summary["rounds"], summary["cross_facility_bytes_per_round"])
    assert summary["max_param_divergence_after_last_round"] <= 1e-6


@pytest.mark.slow
def test_main_job_learns_and_agrees(tmp_path):
    proc, summary = run_recorded(["+experiment=llama_fed", "train.steps=20", "federation.every=5", *TINY], tmp_path)
    for key in (
        "world_size",
        "layout",
        "steps",
        "rounds",
        "first_loss",
        "final_loss",
        "eval_loss",
        "max_param_divergence_after_last_round",
        "aggregation_seconds",
        "tokens_per_second",
        "wall_seconds",
    ):
        assert key in summary, key
    assert summary["world_size"] == 4 and summary["steps"] == 20 and summary["rounds"] == 4
    assert summary["layout"] == {"facility_sizes": [2, 2], "shard_size": 2, "replicas_per_facility": [1, 1]}
    assert len(summary["aggregation_seconds"]) == 4
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    check_values(tmp_path, summary, [1.0, 1.0])  # federation.weights=uniform
    assert (tmp_path / "run" / "config.yaml").exists()
    # Rank 0 alone prints: one layout table, one result line.
    assert proc.stdout.count("done:") == 1 and proc.stdout.count("facility ") == 1


@pytest.mark.slow
def test_unequal_hsdp_facilities(tmp_path):
    # Weights as a list, the larger one on the smaller facility (neither uniform nor by tokens).
    args = [
        "+experiment=llama_fed",
        "distributed.nproc_per_node=6",
        "distributed.federated=[4,2]",
        "distributed.hsdp=2",
        "federation.every=4",
        "federation.weights=[1,3]",
        "train.steps=8",
        "seed=1",
        *TINY,
    ]
    _, summary = run_recorded(args, tmp_path)
    assert summary["layout"] == {"facility_sizes": [4, 2], "shard_size": 2, "replicas_per_facility": [2, 1]}
    assert summary["rounds"] == 2
    check_values(tmp_path, summary, [1.0, 3.0])
    assert summary["final_loss"] < summary["first_loss"]


TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


@pytest.fixture(scope="module")
def torchrun_job(tmp_path_factory):
    """One job for two tests (one launch instead of two): under torchrun, 2 processes = two facilities of one
    rank, weighted 3:1, each on its own contiguous part of the corpus (the synthetic data where the shared
    corpus is absent, so that the torchrun test still runs); ``(folder, summary, on text)``."""
    tmp = tmp_path_factory.mktemp("torchrun")
    text = ["data=text", f"data.path={CORPUS}"] if CORPUS.exists() else []
    args = [
        "+experiment=llama_fed",
        *text,
        "distributed.federated=1",
        "federation.weights=[3,1]",
        "train.steps=6",
        "optim.warmup_steps=2",
        "federation.every=3",
        *TINY,
    ]
    _, summary = run_recorded(args, tmp, launcher=TORCHRUN)
    return tmp, summary, bool(text)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.skipif(not CORPUS.exists(), reason="shared corpus not present")
def test_text_data(torchrun_job):
    # Two facilities of one rank each, each on its own contiguous part of the corpus.
    tmp, summary, text = torchrun_job
    assert text
    assert summary["world_size"] == 2 and summary["layout"]["facility_sizes"] == [1, 1]
    assert summary["final_loss"] < summary["first_loss"]
    check_values(tmp, summary, [3.0, 1.0])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_entry(torchrun_job):
    tmp, summary, _ = torchrun_job
    # Under torchrun the launcher decides the world: 2 processes, here two facilities of 1.
    assert summary["world_size"] == 2 and summary["layout"]["facility_sizes"] == [1, 1]
    check_values(tmp, summary, [3.0, 1.0])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_bad_input_one_line(tmp_path):
    proc, _ = run_cli(["+experiment=llama_fed", "federation.every=0"], tmp_path, timeout=90, launcher=TORCHRUN)
    assert proc.returncode != 0 and proc.stderr.count("error: federation.every=0") == 1, proc.stderr
    # torchrun prints its own summary of failed workers; none of our frames appear.
    assert "xffl_like/" not in proc.stderr


BAD = [
    (["distributed.federated=3"], "does not divide the world size 4"),
    (["distributed.federated=[4,2]"], "sums to 6"),
    (["distributed.hsdp=3"], "distributed.hsdp=3 does not divide"),
    (["train.nonsense=1"], "nonsense"),
    (["model=no_such_model"], "no_such_model"),
    (["data=text", "data.path=/no/such/file.txt"], "/no/such/file.txt"),
    (["federation.every=0"], "federation.every=0"),
    (["train.steps=-3"], "train.steps=-3"),
    (["distributed.nproc_per_node=0"], "distributed.nproc_per_node=0"),
    (["strategy=no_such_strategy"], "no_such_strategy"),
    (["strategy.streams=0"], "streams"),
    (["strategy.bucket_mb=0"], "bucket_mb"),
    (["strategy.only=[no_such_param*]"], "no_such_param"),
    (["strategy.only=[NoSuchModule]"], "NoSuchModule"),
    (["logger.name=foo"], "logger.name='foo'"),
    (
        ["distributed.nproc_per_node=3", "distributed.federated=1", "federation.topology=ring"],
        "needs an even number of facilities, got 3",
    ),
    (["federation.outer.name=lion"], "federation.outer.name='lion'"),
    (["federation.outer.lr=-0.5"], "federation.outer.lr=-0.5"),
    (
        ["federation.outer.lr=fast"],
        "federation.outer.lr='fast': must be a number",
    ),  # the schema's type, at compose time
    (["federation.compression=int4"], "federation.compression='int4'"),
    (["federation.compression=uint8", "federation.chunk_size=0"], "federation.chunk_size=0"),
    (["federation.algorithm=synchronous", "federation=diloco"], "federation.outer does not apply"),
    (["model=hf"], "model.path is not set"),
    (["model.init=lazy"], "model.init='lazy'"),
    (["data=tokens"], "data.path"),
    (["data=text", "data.tokenizer=/no/such/tokenizer.json"], "no tokenizer.json"),
    (["export.hf=maybe"], "export.hf='maybe'"),
    (["strategy.transport=tcp"], "strategy.transport='tcp': valid transports are ['torch', 'mpi']"),
    (["strategy.transport=mpi"], "strategy.transport=mpi needs"),  # the extra, or an MPI launcher
    (["optim.schedule=step"], "optim.schedule='step'"),
    (["optim.schedule=cosine", "optim.min_lr=0.1"], "optim.min_lr=0.1 exceeds optim.lr=0.003"),
    (["train.grad_accum=0"], "train.grad_accum=0"),
    (["train.activation_checkpointing=foo"], "train.activation_checkpointing='foo'"),
    (["optim.name=adam"], "optim.name='adam'"),
    (["+no_such_key=1"], "no_such_key is not a config key of the root config"),
    (["+optim.no_such_key=1"], "optim.no_such_key is not a config key of optim=adamw"),
    (["optim.warmup_steps=null"], "optim.warmup_steps=None"),
    (["optim.betas=[0.9]"], "optim.betas=[0.9]"),
    (["optim.momentum=0.9"], "optim.momentum=0.9 applies to optim=sgd, not optim=adamw: drop it, or select that"),
    (["logger.mode=onlin"], "logger.mode='onlin'"),
    (["checkpoint.keep=0"], "checkpoint.keep=0"),
    (["checkpoint.every_rounds=-1"], "checkpoint.every_rounds=-1"),
    (["checkpoint.async=maybe"], "checkpoint.async='maybe'"),
    (["checkpoint.dir=/proc/no_such_dir"], "checkpoint.dir: /proc/no_such_dir is not writable"),
    (["fault.kill_rank=9", "fault.at_step=3"], "fault.kill_rank=9"),
    (["fault.kill_rank=1", "fault.at_step=0"], "fault.at_step=0"),
    (["fault.nan_rank=1"], "set both"),
    (["federation.on_nonfinite=ignore"], "federation.on_nonfinite='ignore'"),
    (["federation.fragments=5"], "federation.fragments=5 exceeds the model's 4 blocks"),
    (
        ["federation.schedule=[{until_step:5},{until_step:3}]"],
        "federation.schedule[1].until_step=3: must be an integer > 5",
    ),
    (["distributed.max_restarts=-1"], "distributed.max_restarts=-1"),
    (["resume=/no/such/run"], "resume=/no/such/run: no such directory"),
    (["resume=/etc"], "resume=/etc: neither a run directory nor a checkpoint"),
    (
        ["parallel=decentralized", "distributed.hsdp=2"],
        "distributed.hsdp=2 shards the model, but parallel=decentralized",
    ),
    (["parallel=decentralized", "resume=latest"], "parallel=decentralized writes no checkpoints and cannot resume"),
    (
        ["parallel=bagua", "parallel.switch=[{at_step:2,algorithm:decentralized,options:{mode:all}}]"],
        "parallel.switch[0].options={'mode': 'all'}: decentralized takes hierarchical, peer_selection_mode",
    ),
]


@pytest.fixture(scope="module")
def bad_results(tmp_path_factory):
    """Every BAD command line run by ``cli_batch`` in one process (one import instead of one per
    case: ~5 s each here); each case still runs ``python -m xffl_like.run`` as ``__main__`` with
    its own argv, run directory and captured file descriptors 1 and 2."""
    root = tmp_path_factory.mktemp("bad")
    cases = [
        {"args": ["+experiment=llama_fed", *overrides], "run_dir": str(root / str(i))}
        for i, (overrides, _) in enumerate(BAD)
    ]
    (root / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": PYTHONPATH}
    cmd = [sys.executable, "-m", "workers.cli_batch", str(root / "cases.json"), str(root / "results.json")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60 + 10 * len(BAD))
    assert proc.returncode == 0, proc.stderr
    return [Path(c["run_dir"]) for c in cases], json.loads((root / "results.json").read_text())


@pytest.mark.parametrize("index", range(len(BAD)), ids=[b[0][-1] for b in BAD])
def test_bad_input_fails_fast_with_one_line(index, bad_results):
    needle = BAD[index][1]
    run_dirs, results = bad_results
    result = results[index]
    assert result["rc"] != 0
    assert needle in result["stderr"], result["stderr"]
    assert "Traceback" not in result["stderr"] + result["stdout"]
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result["stderr"]  # one line, whichever layer found it
    assert not (run_dirs[index] / "summary.json").exists()


def test_bad_input_in_a_fresh_process(tmp_path):
    """One bad input through a real ``python -m xffl_like.run`` subprocess (what a user types),
    so that the batch runner's in-process execution cannot hide a difference."""
    proc, _ = run_cli(["+experiment=llama_fed", "federation.every=0"], tmp_path, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and len(lines) == 1 and "federation.every=0" in lines[0], proc.stderr
    assert not (tmp_path / "summary.json").exists()


_FAKE_GPU_NODE = """
import sys, torch, torch.distributed as dist
torch.cuda.is_available = lambda: True  # a GPU node, as far as the job can tell
torch.cuda.device_count = lambda: 1
def init_process_group(backend=None, **kwargs):
    print(f"init_process_group backend={backend}", flush=True)
    raise SystemExit(0)
dist.init_process_group = init_process_group
from xffl_like.job import run_under_launcher
run_under_launcher(sys.argv[1:])
"""


@pytest.mark.parametrize("backend, made", [("gloo", "gloo"), ("nccl", "cpu:gloo,cuda:nccl")])
def test_torchrun_default_group_gets_the_configured_backend(tmp_path, backend, made):
    # Under torchrun/srun on a GPU node, distributed.backend=gloo once made the default group
    # cpu:gloo,cuda:nccl (the config was read after it): its gloo subgroups then split NCCL communicators.
    # (nccl: torch.cuda.set_device fails on a CPU build, so that case runs only where CUDA is real.)
    if backend == "nccl" and not torch.cuda.is_available():
        pytest.skip("nccl needs a real CUDA device (torch.cuda.set_device)")
    env = {
        **os.environ,
        "PYTHONPATH": PYTHONPATH,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29599",
        "XFFL_RUN_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _FAKE_GPU_NODE,
            "+experiment=llama_fed",
            "distributed.federated=null",
            f"distributed.backend={backend}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert f"init_process_group backend={made}\n" in proc.stdout, proc.stdout + proc.stderr
