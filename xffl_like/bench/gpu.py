"""``python -m xffl_like.bench.gpu``: does the job work on this machine's GPUs?

Each check runs the job as a user does, ``python -m xffl_like.run`` with Hydra overrides in a
subprocess, reads its ``summary.json`` and prints one line: ``PASS``, ``FAIL`` or ``SKIP``, the
check's name and its figure. ``--only NAME[,NAME]`` runs some of them, ``--list`` names them.
Without a CUDA device it prints one line saying so and exits 0; with one it exits 1 if a check
failed. ``tests/test_cuda.py`` runs the same checks (:func:`run_check`).

Jobs with more than one rank use nccl, one GPU per rank: the job runs gloo on the CPU (a gloo
job's tensors stay on the CPU), so ranks cannot share one GPU; such a check is skipped, naming
the GPUs it needs (:func:`gpus_needed`). On one GPU eight run: bf16, checkpoint (one facility), hub and
hub_topk (two facilities as independent one-rank jobs on the same GPU, through a hub on loopback), meta_hf,
the two throughputs and mfu.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import CONF_DIR
from .children import kill_all, spawn

__all__ = ["CHECKS", "Result", "gpus_needed", "main", "run_check"]

REPO = Path(__file__).resolve().parents[2]
#: The main job, short: 8 steps, a round every 2.
BASE = [
    "+experiment=llama_fed",
    "logger=none",
    "train.steps=8",
    "optim.warmup_steps=2",
    "federation.every=2",
    "train.log_every=4",
    "train.seq_len=64",
    "train.batch_size=4",
]
ONE_GPU = ["distributed.nproc_per_node=1", "distributed.federated=null", "distributed.backend=nccl"]


@dataclass
class Result:
    name: str
    status: str  # PASS | FAIL | SKIP
    figure: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.figure}"


class JobError(RuntimeError):
    """The job exited with an error; ``str()`` is its last error line."""


#: The environment of the jobs whose results a check compares bitwise (checkpoint, hub, hub_topk, streams2):
#: deterministic algorithms and cuBLAS's fixed workspace (:data:`xffl_like.train.speed.DETERMINISTIC_ENV`).
BITWISE = {"XFFL_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


#: Seconds, on one GPU: one short job (a cold compile included), ``bench.mfu``'s eager and compiled 1B runs, one
#: throughput measurement. Each is under ``tools/gpu_run.sh``'s whole budget (540 s, inside a 10-minute command),
#: whose steps bound them again (:func:`xffl_like.bench.gpu_run.steps`).
JOB_TIMEOUT_S, MFU_TIMEOUT_S, THROUGHPUT_TIMEOUT_S = 300, 480, 300


def job(args: list[str], run_dir: Path, timeout: int = JOB_TIMEOUT_S, env: dict | None = None) -> dict:
    """Run the CLI with ``args`` in ``run_dir`` (``env``: more environment); its summary, or :class:`JobError`
    with its error line."""
    env = {**os.environ, "WANDB_MODE": "offline", **(env or {})}
    proc = spawn(
        [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, stderr = proc.communicate(timeout=timeout)  # on a timeout, run_check kills its process group
    if proc.returncode != 0:
        lines = [x for x in stderr.splitlines() if x.strip()]
        errors = [x for x in lines if x.startswith("error:")]
        raise JobError(f"exit {proc.returncode}: {(errors or lines or ['no output'])[-1][:300]}")
    return json.loads((run_dir / "summary.json").read_text())


def gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def ranks(n: int, federated: int | None = 1, hsdp: int | None = None) -> list[str]:
    return [
        f"distributed.nproc_per_node={n}",
        f"distributed.federated={'null' if federated is None else federated}",
        f"distributed.hsdp={'null' if hsdp is None else hsdp}",
        "distributed.backend=nccl",
    ]


def _within(a: float, b: float, rel: float) -> bool:
    return abs(a - b) <= rel * abs(b)


def ran_on_cuda(summary: dict) -> tuple[bool, str]:
    """Whether the job ran on CUDA with nccl (its summary's ``device`` and ``group_backends``: a job that fell
    back to the CPU over gloo must not pass a GPU check); ``(ok, what is wrong or "")``."""
    device = str(summary.get("device") or "")
    world = str((summary.get("group_backends") or {}).get("world") or "")
    ok = device.startswith("cuda") and "nccl" in world
    where = f"ran on {device or 'an unknown device'} (world group: {world or 'unknown'})"
    return ok, "" if ok else f"{where}, not CUDA/nccl"


def same_run(a: dict, b: dict) -> tuple[bool, str]:
    """Whether two summaries hold bitwise the same losses (``final_loss``, every facility's every step)."""
    differ = [k for k in ("final_loss", "facility_losses") if a.get(k) != b.get(k) or a.get(k) is None]
    return not differ, "bitwise equal losses" if not differ else f"{', '.join(differ)} differ"


def bf16_took_effect(low: dict, full: dict, rel: float = 0.02) -> tuple[bool, str]:
    """``train.dtype=bfloat16`` against ``float32`` on the same GPU (their summaries): the parameters inside the
    forward are bf16 in the one and fp32 in the other (``forward_param_dtype``), and the final losses are close
    (``rel``: bf16 trains as fp32 does)."""
    dtypes = (low.get("forward_param_dtype"), full.get("forward_param_dtype"))
    close = _within(low["final_loss"], full["final_loss"], rel)
    figure = (
        f"parameters inside the forward {dtypes[0]} / {dtypes[1]}; final loss {low['final_loss']:.6f} (bf16) vs "
        f"{full['final_loss']:.6f} (fp32): {100 * (low['final_loss'] - full['final_loss']) / full['final_loss']:+.3f}%"
        f" (limit {100 * rel:g}%)"
    )
    ok = close and dtypes == ("bfloat16", "float32")
    return ok, figure + ("" if dtypes[0] == "bfloat16" else ", bf16 was not used")


def checkpoint_peak_within(peaks: list[list[int]], state_bytes: int, bound: float = 1.1) -> tuple[bool, str]:
    """An asynchronous save stages to the host: the device's peak during each save (``device_peak_bytes``'
    second figures) stays under ``bound`` x the weights and optimizer state (``state_bytes``), which a second
    copy on the device would double."""
    during = max((p[1] for p in peaks), default=None)
    if during is None:
        return False, "no save measured"
    ratio = during / state_bytes
    return ratio <= bound, f"device peak during a save {ratio:.3f} x weights + optimizer state (limit {bound})"


# ---------------------------------------------------------------------- the checks
def check_bf16(tmp: Path) -> Result:
    low = job([*BASE, *ONE_GPU, "train.dtype=bfloat16"], tmp / "bf16")
    full = job([*BASE, *ONE_GPU, "train.dtype=float32"], tmp / "fp32")
    ok, figure = bf16_took_effect(low, full)
    for s in (low, full):
        cuda, why = ran_on_cuda(s)
        ok, figure = ok and cuda, figure + (f"; {why}" if why else "")
    return Result("bf16", "PASS" if ok else "FAIL", figure)


def _multi(
    name: str, need: int, extra: list[str], check: Callable[[dict, Path], tuple[bool, str]] | None = None, env=None
):
    """A check of a job over ``need`` GPUs (one per rank, nccl) with ``extra`` overrides (``env``: more
    environment)."""

    def run(tmp: Path) -> Result:
        if gpus() < need:
            return Result(name, "SKIP", f"needs {need} CUDA devices (nccl, one GPU per rank), {gpus()} here")
        s = job([*BASE, *extra], tmp / name, env=env)
        ok, figure = check(s, tmp) if check else (True, "")
        cuda, why = ran_on_cuda(s)
        ok, figure = ok and cuda, f"{figure}{', ' if figure and why else ''}{why}"
        divergence = s.get("max_param_divergence_after_last_round")
        if divergence is not None and s.get("rounds"):
            ok = ok and divergence <= 1e-6
            figure = f"{figure}{', ' if figure else ''}copies agree to {divergence:.1e} after the last round"
        return Result(
            name,
            "PASS" if ok else "FAIL",
            f"final loss {s['final_loss']:.4f}, {s['rounds']} rounds, "
            f"{s['tokens_per_second']:.0f} tokens/s{', ' + figure if figure else ''}",
        )

    run.__name__ = f"check_{name}"
    run.gpus = need  # what gpus_needed reads
    return run


def gpus_needed(name: str) -> int:
    """The CUDA devices check ``name`` needs to run (fewer: it is skipped, saying so)."""
    return getattr(CHECKS[name], "gpus", 1)


#: The checkpoint check's model: ``llama_bench`` at batch 1 x 32 tokens, whose activations are small beside its
#: weights and AdamW state (12 bytes per parameter): a second copy of the state on the device would show.
CHECKPOINT_MODEL = ["model=llama_bench", "model.init=meta", "train.batch_size=1", "train.seq_len=32"]


def check_checkpoint(tmp: Path) -> Result:
    """An async checkpoint's device peak, and a job killed after one and restarted by the launcher ending
    bitwise equal to the uninterrupted one: two facilities on two GPUs, else one facility on one GPU."""
    layout = ranks(2) if gpus() >= 2 else ONE_GPU
    args = [*BASE, *layout, *CHECKPOINT_MODEL, "checkpoint.async=true", "seed=1"]
    ref = job(args, tmp / "ref", env=BITWISE)
    kill_rank = 1 if gpus() >= 2 else 0
    killed = job(
        [*args, f"fault.kill_rank={kill_rank}", "fault.at_step=7", "distributed.max_restarts=1"],
        tmp / "killed",
        env=BITWISE,
    )
    # Every facility here is one rank: it holds the whole model, fp32 weights and AdamW's two moments.
    within, peak = checkpoint_peak_within(ref["checkpoints"]["device_peak_bytes"], 12 * parameters("llama_bench"))
    a, b = final_tensors(tmp / "killed"), final_tensors(tmp / "ref")
    differ = [k for k in b if not k.startswith("rank") and (k not in a or not _equal(a[k], b[k]))]
    same = not differ and killed["facility_losses"] == ref["facility_losses"]
    restarted = killed["checkpoints"]["restarts"] == 1 and killed["checkpoints"]["resumed_from"] is not None
    cuda, why = ran_on_cuda(ref)
    ok = same and restarted and within and cuda
    return Result(
        "checkpoint",
        "PASS" if ok else "FAIL",
        f"{peak}; resumed after a kill: "
        f"{'bitwise equal' if same else f'{len(differ)} tensors differ (first {differ[:1]})'}"
        f"{'' if restarted else ', not restarted from a checkpoint'}{'; ' + why if why else ''}",
    )


#: Facilities as independent jobs through a hub, all on one GPU (each its own one-rank nccl world; rounds cross
#: the hub's loopback gRPC through host memory).
HUB_OUTER = ["federation.outer.name=nesterov", "federation.outer.lr=0.7", "federation.outer.momentum=0.9"]


def _hub(name: str, extra: list[str]):
    """Two facilities, each a one-rank job on this machine's first GPU, through an ``--insecure`` hub on loopback:
    both ran on CUDA, made every round, and end holding bitwise the same weights (the hub's last θ_global)."""

    def run(tmp: Path) -> Result:
        from .hub_jobs import insecure_hub, start_job, wait_job

        env = {
            **os.environ,
            "WANDB_MODE": "offline",
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
            **BITWISE,
        }
        with insecure_hub(tmp / "hub-state", env) as (_, port):
            args = [*BASE, *ONE_GPU, *HUB_OUTER, *extra, f"federation.elastic.hub=127.0.0.1:{port}"]
            procs = {f: start_job([*args, f"federation.elastic.facility={f}"], tmp / f, env) for f in ("a", "b")}
            summaries = {f: wait_job(p, tmp / f, JOB_TIMEOUT_S) for f, p in procs.items()}
        weights = {f: {k: v for k, v in final_tensors(tmp / f).items() if ".model." in k} for f in procs}
        same = bool(weights["a"]) and weights["a"].keys() == weights["b"].keys()
        same = same and all(_equal(weights["a"][k], weights["b"][k]) for k in weights["a"])
        rounds = [s["rounds"] for s in summaries.values()]
        ok, figure = same and min(rounds) >= 4, f"rounds {rounds}; final weights {'equal' if same else 'differ'}"
        for s in summaries.values():
            cuda, why = ran_on_cuda(s)
            ok, figure = ok and cuda, figure + (f"; {why}" if why else "")
        return Result(name, "PASS" if ok else "FAIL", figure)

    run.__name__ = f"check_{name}"
    return run


def _equal(a, b) -> bool:
    import torch

    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def final_tensors(run_dir: Path) -> dict:
    """Every tensor of the run's newest checkpoint, read on this process, by dotted key."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from ..checkpoint.safe import SafeFileSystemReader
    from ..checkpoint.store import latest_checkpoint

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        nested = _load_state_dict_from_keys(
            storage_reader=SafeFileSystemReader(str(latest_checkpoint(run_dir / "checkpoints")))
        )

    def flat(node, prefix=""):
        for key, value in node.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", value)]

    return dict(flat(nested))


def check_meta_hf(tmp: Path) -> Result:
    run = tmp / "meta_hf"
    s = job([*BASE, *ONE_GPU, "model.init=meta", "export.hf=true"], run)
    files = sorted(p.name for p in (run / "hf").glob("*")) if (run / "hf").is_dir() else []
    cuda, why = ran_on_cuda(s)
    ok = "config.json" in files and any(f.endswith(".safetensors") for f in files) and cuda
    return Result(
        "meta_hf",
        "PASS" if ok else "FAIL",
        f"final loss {s['final_loss']:.4f}; hf/: {', '.join(files) or 'missing'}{'; ' + why if why else ''}",
    )


def parameters(model: str) -> int:
    """The parameter count of ``conf/model/<model>.yaml`` (Llama: embeddings, blocks, final norm, head)."""
    from omegaconf import OmegaConf

    m = OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml")
    kv = m.dim * m.n_kv_heads // m.n_heads
    block = 2 * m.dim * m.dim + 2 * m.dim * kv + 3 * m.dim * m.ffn_dim + 2 * m.dim
    return m.vocab_size * m.dim * (1 if m.tie_embeddings else 2) + m.n_layers * block + m.dim


def check_mfu(tmp: Path) -> Result:
    """``python -m xffl_like.bench.mfu``: llama3_2_1b, bf16, sequence 2048, steady-state steps, with and
    without ``torch.compile``."""
    proc = spawn(
        [sys.executable, "-m", "xffl_like.bench.mfu", "--model", "llama3_2_1b", "--seq", "2048", "--batch", "4",
         "--compile", "both"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    stdout, stderr = proc.communicate(timeout=MFU_TIMEOUT_S)
    lines = [x for x in stdout.splitlines() if x.strip()]
    if proc.returncode != 0:
        errors = [x for x in stderr.splitlines() if x.strip()]
        return Result("mfu_llama3_2_1b", "FAIL", f"exit {proc.returncode}: {(errors or ['no output'])[-1][:300]}")
    return Result("mfu_llama3_2_1b", "PASS", " | ".join(lines))


#: Timed steps of a throughput check: ``WARMUP`` untimed steps first (the compile, recompiles, the allocator's
#: warm-up), then ``TIMED`` steps between two device synchronisations (:func:`xffl_like.bench.mfu.measure`).
WARMUP, TIMED = 5, 20


def throughput_verdict(m: dict, floor: float) -> tuple[str, str]:
    """(status, figure) of a steady-state measurement ``m`` (:class:`~xffl_like.bench.mfu.Measurement` as a dict):
    ``PASS`` when its MFU is at least ``floor``, ``FAIL`` below it or off CUDA, ``SKIP`` when the GPU's peak is
    unknown (``XFFL_PEAK_TFLOPS`` gives it)."""
    mfu, cuda = m.get("mfu"), str(m.get("device", "cpu")) != "cpu"
    figure = (
        f"{m['tokens_per_second']:,.0f} tokens/s, "
        f"{'MFU n/a (unknown GPU peak: set XFFL_PEAK_TFLOPS)' if mfu is None else f'MFU {mfu:.1%}'}"
        f" (floor {floor:.0%}) over {m['timed_steps']} steady-state steps, {m['dtype']}, compiled, activation "
        f"checkpointing, on {m['device']}"
    )
    if not cuda:
        return "FAIL", figure + "; not on CUDA"
    if mfu is None:
        return "SKIP", figure
    return ("PASS" if mfu >= floor else "FAIL"), figure


def _throughput(model: str, seq: int, batch: int, floor: float):
    """Steady-state tokens/s and MFU of ``model`` trained as the job does with bf16, ``torch.compile`` and full
    activation checkpointing (``python -m xffl_like.bench.mfu``: :data:`WARMUP` untimed steps, then :data:`TIMED`
    timed ones; no rounds, evaluations or checkpoints in the window). It passes at MFU >= ``floor``, a floor that
    catches a fallback (eager blocks, fp32 matmuls, the CPU), not a target: recomputing the blocks is not
    counted, so MFU here is about 3/4 of ``mfu_llama3_2_1b``'s (no activation checkpointing)."""

    def run(tmp: Path) -> Result:
        name = f"throughput_{model}"
        proc = spawn(
            [sys.executable, "-m", "xffl_like.bench.mfu", "--model", model, "--seq", str(seq), "--batch",
             str(batch), "--dtype", "bfloat16", "--compile", "true", "--warmup", str(WARMUP), "--steps",
             str(TIMED), "--json", "train.activation_checkpointing=full"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        stdout, stderr = proc.communicate(timeout=THROUGHPUT_TIMEOUT_S)  # on a timeout, run_check kills it
        found = [json.loads(x) for x in stdout.splitlines() if x.startswith("{")]
        if proc.returncode != 0 or not found:
            errors = [x for x in stderr.splitlines() if x.strip()]
            return Result(name, "FAIL", f"exit {proc.returncode}: {(errors or ['no output'])[-1][:300]}")
        return Result(name, *throughput_verdict(found[-1], floor))

    run.__name__ = f"check_throughput_{model}"
    return run


STREAMS2 = [*ranks(2), "strategy=layer_by_layer", "strategy.streams=2"]


def _same_as_one_stream(s: dict, tmp: Path) -> tuple[bool, str]:
    """streams2's job against the same job on one stream: the streams change when bytes move, never the values."""
    one = job([*BASE, *STREAMS2[:-1], "strategy.streams=1"], tmp / "streams1", env=BITWISE)
    ok, figure = same_run(s, one)
    return ok, f"vs one stream: {figure}"


CHECKS: dict[str, Callable[[Path], Result]] = {
    "bf16": check_bf16,
    "facilities": _multi("facilities", 2, [*ranks(2), "federation.weights=[0.7,0.3]"]),
    "hsdp": _multi("hsdp", 4, ranks(4, federated=2, hsdp=1)),
    "streams2": _multi("streams2", 2, STREAMS2, _same_as_one_stream, env=BITWISE),
    "uint8": _multi("uint8", 2, [*ranks(2), "federation.compression=uint8"]),
    "streaming": _multi(
        "streaming",
        2,
        [*ranks(2), "train.steps=8", "federation.every=4", "federation.fragments=2", "federation.overlap_steps=1"],
    ),
    "decentralized": _multi("decentralized", 2, [*ranks(2, federated=None), "parallel=decentralized"]),
    "bagua": _multi("bagua", 2, [*ranks(2, federated=None), "parallel=bagua"]),
    "checkpoint": check_checkpoint,
    "hub": _hub("hub", []),
    "hub_topk": _hub("hub_topk", ["federation.compression=topk", "federation.error_feedback=true"]),
    "meta_hf": check_meta_hf,
    # llama_bench at batch 16 x 256 measured the step's fixed cost, not its arithmetic: on an H200 eager 1.3%,
    # compiled 1.4-1.8%, the same ~60-80 ms per step as batch 128's 12.9% (docs/running.md, "On GPUs")
    "throughput_llama_bench": _throughput("llama_bench", 256, 128, floor=0.08),
    "throughput_llama3_2_1b": _throughput("llama3_2_1b", 1024, 4, floor=0.20),
    "mfu_llama3_2_1b": check_mfu,
}


def run_check(name: str, tmp: Path | None = None) -> Result:
    """Run check ``name`` (a key of :data:`CHECKS`). Any exception is a ``FAIL`` naming it in one line (a job
    that fails: its error line), so the next check still runs; every process the check started (each in its own
    process group: launchers' workers, a hub, its facilities) is killed when it ends, passed or not."""
    with tempfile.TemporaryDirectory(prefix=f"xffl-gpu-{name}-") as scratch:
        where = Path(tmp or scratch)
        try:
            return CHECKS[name](where)
        except Exception as exc:  # noqa: BLE001 - every failure of a check is that check's FAIL line
            text = " ".join(str(exc).split()) or "no message"
            return Result(name, "FAIL", f"{type(exc).__name__}: {text}"[:400])
        finally:
            kill_all()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xffl_like.bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated check names (see --list)")
    parser.add_argument("--list", action="store_true", help="print the checks' names and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(CHECKS))
        return 0
    names = list(CHECKS) if args.only is None else [x.strip() for x in args.only.split(",") if x.strip()]
    unknown = [x for x in names if x not in CHECKS]
    if unknown:
        print(f"error: --only {','.join(unknown)}: no such check; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    if gpus() == 0:
        print("no CUDA device found: the GPU checks need one (torch.cuda.is_available() is False); nothing to run")
        return 0
    failed = 0
    for name in names:
        result = run_check(name)
        print(result.line(), flush=True)
        failed += result.status == "FAIL"
    return 1 if failed else 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
