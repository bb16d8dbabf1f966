"""``python -m xffl_like.bench.gpu``: does the job work on this machine's GPUs?

Each check runs the job as a user does, ``python -m xffl_like.run`` with Hydra overrides in a
subprocess, reads its ``summary.json`` and prints one line: ``PASS``, ``FAIL`` or ``SKIP``, the
check's name and its figure. ``--only NAME[,NAME]`` runs some of them, ``--list`` names them.
Without a CUDA device it prints one line saying so and exits 0; with one it exits 1 if a check
failed. ``tests/test_cuda.py`` runs the same checks (:func:`run_check`).

Jobs with more than one rank use nccl, one GPU per rank: the job runs gloo on the CPU (a gloo
job's tensors stay on the CPU), so ranks cannot share one GPU; such a check is skipped, naming
the GPUs it needs.
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

__all__ = ["CHECKS", "Result", "main", "run_check"]

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


def job(args: list[str], run_dir: Path, timeout: int = 900) -> dict:
    """Run the CLI with ``args`` in ``run_dir``; its summary, or :class:`JobError` with its error line."""
    env = {**os.environ, "WANDB_MODE": "offline"}
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.run", *args, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
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


def bf16_took_effect(bf16_loss: float, fp32_loss: float, rel: float = 0.02) -> tuple[bool, str]:
    """bf16 vs fp32 on the same GPU: close (``rel``) but not identical (identical: bf16 was ignored)."""
    close, differs = _within(bf16_loss, fp32_loss, rel), bf16_loss != fp32_loss
    figure = (
        f"final loss {bf16_loss:.6f} (bf16) vs {fp32_loss:.6f} (fp32, same GPU): "
        f"{100 * (bf16_loss - fp32_loss) / fp32_loss:+.3f}% (limit {100 * rel:g}%)"
    )
    return close and differs, figure + ("" if differs else ", identical: bf16 was not used")


# ---------------------------------------------------------------------- the checks
def check_bf16(tmp: Path) -> Result:
    low = job([*BASE, *ONE_GPU, "train.dtype=bfloat16"], tmp / "bf16")
    full = job([*BASE, *ONE_GPU, "train.dtype=float32"], tmp / "fp32")
    ok, figure = bf16_took_effect(low["final_loss"], full["final_loss"])
    for s in (low, full):
        cuda, why = ran_on_cuda(s)
        ok, figure = ok and cuda, figure + (f"; {why}" if why else "")
    return Result("bf16", "PASS" if ok else "FAIL", figure)


def _multi(name: str, need: int, extra: list[str], check: Callable[[dict, Path], tuple[bool, str]] | None = None):
    """A check of a job over ``need`` GPUs (one per rank, nccl) with ``extra`` overrides."""

    def run(tmp: Path) -> Result:
        if gpus() < need:
            return Result(name, "SKIP", f"needs {need} CUDA devices (nccl, one GPU per rank), {gpus()} here")
        s = job([*BASE, *extra], tmp / name)
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
    return run


def check_checkpoint(tmp: Path) -> Result:
    if gpus() < 2:
        return Result("checkpoint", "SKIP", f"needs 2 CUDA devices (two facilities with rounds, nccl), {gpus()} here")
    args = [*BASE, *ranks(2), "checkpoint.async=true", "seed=1"]
    ref = job(args, tmp / "ref")
    killed = job([*args, "fault.kill_rank=1", "fault.at_step=7", "distributed.max_restarts=1"], tmp / "killed")
    peaks = ref["checkpoints"]["device_peak_bytes"]
    ratio = max(during / before for before, during in peaks) if peaks else float("nan")
    a, b = final_tensors(tmp / "killed"), final_tensors(tmp / "ref")
    differ = [k for k in b if not k.startswith("rank") and (k not in a or not _equal(a[k], b[k]))]
    same = not differ and killed["facility_losses"] == ref["facility_losses"]
    restarted = killed["checkpoints"]["restarts"] == 1 and killed["checkpoints"]["resumed_from"] is not None
    cuda, why = ran_on_cuda(ref)
    ok = same and restarted and ratio < 1.1 and cuda
    return Result(
        "checkpoint",
        "PASS" if ok else "FAIL",
        f"peak during a save / before it {ratio:.3f} (limit 1.1) over {len(peaks)} saves; resumed after a "
        f"kill: {'bitwise equal' if same else f'{len(differ)} tensors differ (first {differ[:1]})'}"
        f"{'' if restarted else ', not restarted from a checkpoint'}{'; ' + why if why else ''}",
    )


def _equal(a, b) -> bool:
    import torch

    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def final_tensors(run_dir: Path) -> dict:
    """Every tensor of the run's newest checkpoint, read on this process, by dotted key."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from ..checkpoint.store import SafeFileSystemReader, latest_checkpoint

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


def _model_conf(model: str) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{model}.yaml"))


def check_mfu(tmp: Path) -> Result:
    """``python -m xffl_like.bench.mfu``: llama3_2_1b, bf16, sequence 2048, steady-state steps, with and
    without ``torch.compile``."""
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.bench.mfu", "--model", "llama3_2_1b", "--seq", "2048", "--batch", "4",
         "--compile", "both"],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    lines = [x for x in proc.stdout.splitlines() if x.strip()]
    if proc.returncode != 0:
        errors = [x for x in proc.stderr.splitlines() if x.strip()]
        return Result("mfu_llama3_2_1b", "FAIL", f"exit {proc.returncode}: {(errors or ['no output'])[-1][:300]}")
    return Result("mfu_llama3_2_1b", "PASS", " | ".join(lines))


def peak_flops() -> float | None:
    """The device's bf16 dense peak by its name and SKU (:func:`xffl_like.bench.mfu.peak_flops`)."""
    from .mfu import peak_flops as by_name

    peak = by_name()
    return peak[0] if peak else None


def _throughput(model: str, seq: int, batch: int):
    def run(tmp: Path) -> Result:
        name = f"throughput_{model}"
        s = job(
            [
                "+experiment=llama_fed",
                "logger=none",
                *ONE_GPU,
                f"model={model}",
                "train.dtype=bfloat16",
                "train.activation_checkpointing=full",
                "train.steps=20",
                "optim.warmup_steps=2",
                "train.log_every=10",
                f"train.seq_len={seq}",
                f"train.batch_size={batch}",
                "checkpoint.async=false",
            ],
            tmp / name,
        )
        from ..models import LlamaConfig
        from .mfu import flops_per_token

        tps, peak = s["tokens_per_second"], peak_flops()
        # 6 N + 12 L d T FLOPs per token (bench.mfu); recomputing the blocks is not counted. The whole job's
        # tokens/s (rounds, evaluations included): `mfu_llama3_2_1b` times steady-state steps only.
        per_token = flops_per_token(LlamaConfig.from_mapping(_model_conf(model)), seq)[0]
        mfu = f"MFU {per_token * tps / peak:.1%}" if peak else "MFU n/a (unknown GPU peak)"
        cuda, why = ran_on_cuda(s)
        figure = f"{tps:,.0f} tokens/s, {mfu} (whole job, bf16, activation checkpointing)"
        return Result(name, "PASS" if cuda else "FAIL", figure + (f"; {why}" if why else ""))

    run.__name__ = f"check_throughput_{model}"
    return run


STREAMS2 = [*ranks(2), "strategy=layer_by_layer", "strategy.streams=2"]


def _same_as_one_stream(s: dict, tmp: Path) -> tuple[bool, str]:
    """streams2's job against the same job on one stream: the streams change when bytes move, never the values."""
    one = job([*BASE, *STREAMS2[:-1], "strategy.streams=1"], tmp / "streams1")
    ok, figure = same_run(s, one)
    return ok, f"vs one stream: {figure}"


CHECKS: dict[str, Callable[[Path], Result]] = {
    "bf16": check_bf16,
    "facilities": _multi("facilities", 2, [*ranks(2), "federation.weights=[0.7,0.3]"]),
    "hsdp": _multi("hsdp", 4, ranks(4, federated=2, hsdp=1)),
    "streams2": _multi("streams2", 2, STREAMS2, _same_as_one_stream),
    "uint8": _multi("uint8", 2, [*ranks(2), "federation.compression=uint8"]),
    "streaming": _multi(
        "streaming",
        2,
        [*ranks(2), "train.steps=8", "federation.every=4", "federation.fragments=2", "federation.overlap_steps=1"],
    ),
    "decentralized": _multi("decentralized", 2, [*ranks(2, federated=None), "parallel=decentralized"]),
    "bagua": _multi("bagua", 2, [*ranks(2, federated=None), "parallel=bagua"]),
    "checkpoint": check_checkpoint,
    "meta_hf": check_meta_hf,
    "throughput_llama_bench": _throughput("llama_bench", 256, 8),
    "throughput_llama3_2_1b": _throughput("llama3_2_1b", 1024, 4),
    "mfu_llama3_2_1b": check_mfu,
}


def run_check(name: str, tmp: Path | None = None) -> Result:
    """Run check ``name`` (a key of :data:`CHECKS`); a job that fails is a ``FAIL`` naming its error line."""
    with tempfile.TemporaryDirectory(prefix=f"xffl-gpu-{name}-") as scratch:
        where = Path(tmp or scratch)
        try:
            return CHECKS[name](where)
        except (JobError, subprocess.TimeoutExpired, FileNotFoundError, KeyError) as exc:
            return Result(name, "FAIL", f"{type(exc).__name__}: {exc}")


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
