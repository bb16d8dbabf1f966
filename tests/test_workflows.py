"""Slurm rendering: the scripts, the dry run, and what the scripts do when run (with fake srun/torchrun)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import REPO as ROOT

from xffl_like.distributed.slurm import SlurmOptions, main, render


def test_render_two_facilities():
    scripts = render(
        [2, 1], SlurmOptions(gpus_per_node=4, partition="gpu", time="00:30:00", overrides=("+experiment=llama_fed",))
    )
    assert [s.filename for s in scripts] == ["xffl-f0.sbatch", "xffl-f1.sbatch"]
    f0, f1 = (s.text for s in scripts)
    for text in (f0, f1):
        assert "'distributed.federated=[8,4]' +experiment=llama_fed" in text
        assert "torchrun --nnodes=3 --nproc-per-node=4" in text
        assert "--rdzv-backend=static" in text and "--node-rank=$((XFFL_NODE_OFFSET + SLURM_NODEID))" in text
        assert "#SBATCH --partition=gpu\n" in text and "#SBATCH --time=00:30:00\n" in text
        assert "-m xffl_like.run" in text
    assert "#SBATCH --nodes=2\n" in f0 and "export XFFL_NODE_OFFSET=0 " in f0 and "scontrol show hostnames" in f0
    assert "#SBATCH --nodes=1\n" in f1 and "export XFFL_NODE_OFFSET=2 " in f1
    assert "XFFL_RDZV_ENDPOINT:?" in f1  # the others must be told where facility 0 is


def test_federated_override():
    with pytest.raises(ValueError, match=r"distributed.federated=\[8,4\]"):
        render([2, 1], SlurmOptions(gpus_per_node=4, overrides=("distributed.federated=[4,8]",)))
    # One allocation may hold several facilities: the user's split is kept.
    (one,) = render([2], SlurmOptions(gpus_per_node=4, overrides=("distributed.federated=4",)))
    assert "distributed.federated=4" in one.text and "[8]" not in one.text
    with pytest.raises(ValueError):
        render([2, 0], SlurmOptions(gpus_per_node=4))


def test_dry_run_prints_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["--nodes", "2,1", "--gpus-per-node", "4", "--dry-run", "--", "+experiment=llama_fed"]) == 0
    out = capsys.readouterr().out
    assert "# ===== xffl-f0.sbatch" in out and "# ===== xffl-f1.sbatch" in out
    assert "'distributed.federated=[8,4]'" in out
    assert "sbatch --export=ALL,XFFL_RDZV_ENDPOINT=HOST:PORT" in out
    assert list(tmp_path.iterdir()) == []


def test_checked_in_examples_match_the_renderer():
    for name, nodes in (("one_facility", [2]), ("two_facilities", [2, 1])):
        opts = SlurmOptions(gpus_per_node=4, job_name=name, overrides=("+experiment=llama_fed",))
        for script in render(nodes, opts):
            path = ROOT / "workflows" / "slurm" / script.filename
            assert path.read_text() == script.text, f"{path} is stale: regenerate it (see workflows/slurm/README.md)"


FAKE_SRUN = """#!/bin/bash
# Run the command once per node of the allocation, as srun would, with SLURM_NODEID set.
while [[ "$1" == --* ]]; do shift; done
for ((i = 0; i < SLURM_NNODES; i++)); do SLURM_NODEID=$i "$@" || exit $?; done
"""
FAKE_SCONTROL = """#!/bin/bash
echo node-a; echo node-b
"""
FAKE_TORCHRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_OUT/torchrun.$(date +%s%N)"
"""


def _fake_bin(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("torchrun", FAKE_TORCHRUN)):
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return bin_dir


def _run_script(tmp_path: Path, text: str, nnodes: int, endpoint: str | None = None):
    """Run an sbatch script as Slurm would on ``nnodes`` nodes; return the process and torchrun's argv per node."""
    out = Path(tempfile.mkdtemp(dir=tmp_path))
    script = out / "job.sbatch"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "XFFL_"))}
    env.update(
        PATH=f"{_fake_bin(tmp_path)}:{os.environ['PATH']}",
        SLURM_NNODES=str(nnodes),
        SLURM_JOB_NODELIST="node-[a-b]",
        SLURM_JOB_ID="123",
        FAKE_OUT=str(out),
    )
    if endpoint:
        env["XFFL_RDZV_ENDPOINT"] = endpoint
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, cwd=out, timeout=30)
    calls = [p.read_text().splitlines() for p in sorted(out.glob("torchrun.*"))]
    return proc, calls


@pytest.mark.cli
def test_scripts_start_one_torchrun_per_node_with_contiguous_node_ranks(tmp_path):
    tricky = "+tags=[a b,c]"  # survives sbatch -> srun -> bash -c -> torchrun intact
    f0, f1 = render([2, 1], SlurmOptions(gpus_per_node=4, overrides=("+experiment=llama_fed", tricky)))
    proc, calls = _run_script(tmp_path, f0.text, nnodes=2)
    assert proc.returncode == 0, proc.stderr
    assert "facility 0 hosts the rendezvous at node-a:29500" in proc.stdout
    assert [next(a for a in c if a.startswith("--node-rank=")) for c in calls] == ["--node-rank=0", "--node-rank=1"]
    for call in calls:
        assert "--rdzv-endpoint=node-a:29500" in call and "--nnodes=3" in call
        assert call[call.index("-m") :] == [
            "-m",
            "xffl_like.run",
            "distributed.federated=[8,4]",
            "+experiment=llama_fed",
            tricky,
        ]

    proc, calls = _run_script(tmp_path, f1.text, nnodes=1)
    assert proc.returncode != 0 and "set XFFL_RDZV_ENDPOINT" in proc.stderr and not calls
    proc, calls = _run_script(tmp_path, f1.text, nnodes=1, endpoint="node-a:29500")
    assert proc.returncode == 0, proc.stderr
    assert len(calls) == 1 and "--node-rank=2" in calls[0] and "--rdzv-endpoint=node-a:29500" in calls[0]


@pytest.mark.cli
def test_cli_runs_as_module():
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.distributed.slurm", "--nodes", "1", "--gpus-per-node", "2", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "'distributed.federated=[2]'" in proc.stdout


def test_elastic_scripts_are_independent_jobs_dialling_the_hub():
    """--hub: one script per facility, each its own rendezvous and job, dialling out to the hub with its own
    certificate, leaving at walltime (USR1)."""
    opts = SlurmOptions(
        gpus_per_node=4, time="02:00:00", hub="login1:29510", certs="/site/xffl", overrides=("+experiment=llama_fed",)
    )
    f0, f1 = render([2, 1], opts)
    assert (f0.filename, f1.filename) == ("xffl-f0.sbatch", "xffl-f1.sbatch")
    for script, name, nodes in ((f0, "xffl-f0", 2), (f1, "xffl-f1", 1)):
        lines = script.text.splitlines()
        for want in (
            f"#SBATCH --job-name={name}",
            f"#SBATCH --nodes={nodes}",
            "#SBATCH --ntasks-per-node=4",
            "#SBATCH --gpus-per-node=4",
            "#SBATCH --signal=USR1@120",
            "#SBATCH --time=02:00:00",
            "#   python -m xffl_like.hub init CERTS --facilities xffl-f0,xffl-f1 --host login1",
            "#   nohup python -m xffl_like.hub serve --port 29510 --certs CERTS --state hub-state > hub.log 2>&1 &",
            'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)"',
            "srun --kill-on-bad-exit=1 python -m xffl_like.run distributed.federated=null "
            f"federation.elastic.hub=login1:29510 federation.elastic.facility={name} "
            f"federation.elastic.ca=/site/xffl/ca.crt federation.elastic.cert=/site/xffl/{name}.crt "
            f"federation.elastic.key=/site/xffl/{name}.key +experiment=llama_fed",
        ):
            assert want in lines, (want, script.text)
        assert "XFFL_RDZV_ENDPOINT" not in script.text and "torchrun" not in script.text  # nothing shared
    with pytest.raises(ValueError, match="leave them out"):
        render([1], SlurmOptions(gpus_per_node=4, hub="login1:29510", overrides=("distributed.federated=2",)))
    with pytest.raises(ValueError, match="leave them out"):
        render([1], SlurmOptions(gpus_per_node=4, hub="login1:29510", overrides=("federation.elastic.key=/k",)))
    with pytest.raises(ValueError, match="HOST:PORT"):
        render([1], SlurmOptions(gpus_per_node=4, hub="login1"))
    with pytest.raises(ValueError, match="cannot both hold"):  # it was silently ignored
        render([1], SlurmOptions(gpus_per_node=4, hub="login1:29510", rdzv_endpoint="h:1"))


@pytest.mark.parametrize(
    "args, says",
    [
        (["--dry-run", "--no-submit"], "--dry-run and --no-submit cannot both hold"),
        (["--dry-run", "--out-dir", "x"], "--dry-run and --out-dir x cannot both hold"),
        (["--dry-run", "--certs", "c"], "--certs c without --hub"),
        (["--dry-run", "--hub", "h:1", "--hub", "h:2"], "--hub given twice"),
        (["--dry-run", "--nodes", "2"], "--nodes given twice"),
        (["--dry-run", "--", "federation.elastic.hub=h:1"], "use --hub HOST:PORT"),
        (["--dry-run", "--hub", "h:1", "--rdzv-endpoint", "h:2"], "cannot both hold"),
    ],
)
def test_options_that_would_be_ignored_are_refused(args, says, tmp_path, capsys, monkeypatch):
    """Every pair of the renderer's options where one would be silently ignored: one line, exit 2, nothing written."""
    monkeypatch.chdir(tmp_path)
    try:
        code = main(["--nodes", "1", "--gpus-per-node", "1", *args])
    except SystemExit as exc:  # argparse's refusals
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and says in err, err
    assert [line for line in err.splitlines() if "error" in line] == [err.splitlines()[-1]]
    assert list(tmp_path.iterdir()) == []
