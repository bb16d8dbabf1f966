"""``tools/gpu_run.sh``: everything one GPU machine should run, in one prepared command.

Three modes:

- ``--prepare`` (on a CPU machine with pip): a wheelhouse, ``.gpu/wheels`` (ignored by git), of exactly what
  the GPU image lacks (:data:`WHEELS`, at the versions installed here), for CPython 3.12 manylinux x86_64, and
  a copy of ``../shared/data`` in ``.gpu/data``. Carry ``.gpu`` to the GPU machine.
- no flag (on the GPU machine): installs the wheelhouse offline into a target folder, checks that every module
  the job imports imports (:data:`IMPORTS`), and runs :func:`steps` in priority order with ``PYTHONPATH`` =
  that folder and this checkout, on the image's torch, each with its own timeout inside one ``--budget``,
  writing a log per step and ``gpu_run.txt`` (one line per step) to ``$OUT`` (or ``--out``).
- ``--cpu``: the same script end to end on this machine's CPU: ``llama_tiny`` for the 1B, gloo, a few steps
  (the bench.gpu steps then say that there is no CUDA device and pass).

This file imports the standard library only: it runs as a script (``tools/gpu_run.sh``) before the wheels that
``xffl_like``'s own imports need are installed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_DIR = REPO / ".gpu"
#: What the GPU image (Python 3.12, torch 2.11 CUDA, grpcio, transformers, safetensors, tokenizers, numpy,
#: PyYAML, tqdm) lacks and the job imports: Hydra, OmegaConf and its parser, and cryptography (the hub's
#: identity) with its cffi. W&B is imported only by ``logger=wandb`` (the steps run ``logger=none``).
WHEELS = ["hydra-core", "omegaconf", "antlr4-python3-runtime", "cryptography", "cffi", "pycparser"]
#: Built here from their source distribution (pure Python; PyPI holds no wheel of them).
SDIST_ONLY = {"antlr4-python3-runtime"}
PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_28_x86_64", "manylinux_2_34_x86_64"]
#: Every module the steps import, with the distribution that provides it (for the error line).
IMPORTS = {
    "torch": "torch",
    "hydra": "hydra-core",
    "omegaconf": "omegaconf",
    "antlr4": "antlr4-python3-runtime",
    "yaml": "PyYAML",
    "cryptography.x509": "cryptography",
    "_cffi_backend": "cffi",
    "pycparser": "pycparser",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "grpc": "grpcio",
    "tqdm": "tqdm",
}
#: Seconds for all steps: one GPU command runs at most 10 minutes (bench.gpu's job timeouts stay under it).
BUDGET_S = 540
WHEELHOUSE_LIMIT = 64 * 2**20  # what travels with the working tree to the GPU machine, at most
#: bench.gpu's checks that no earlier step runs (``mfu_llama3_2_1b`` is the mfu step, compiled only).
REST = [
    "hub_topk",
    "meta_hf",
    "throughput_llama_bench",
    "throughput_llama3_2_1b",
    "facilities",
    "hsdp",
    "streams2",
    "uint8",
    "streaming",
    "decentralized",
    "bagua",
]


class Stop(Exception):
    """Bad input or a machine that cannot run the steps: one line, exit 2."""


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    timeout_s: int


def steps(cpu: bool, py: str, scratch: Path) -> list[Step]:
    """The steps in priority order: the README's main job on one GPU, bench.mfu (llama3_2_1b, bf16, sequence
    2048, compiled), then bench.gpu's bf16, checkpoint, hub and the rest. ``cpu``: the dry run's small twins."""
    main = [py, "-m", "xffl_like.run", "+experiment=llama_fed", "distributed.nproc_per_node=1"]
    main += ["distributed.federated=null", "logger=none", f"hydra.run.dir={scratch / 'main'}"]
    mfu = [py, "-m", "xffl_like.bench.mfu"]
    gpu = [py, "-m", "xffl_like.bench.gpu", "--only"]
    if cpu:
        main += ["distributed.backend=gloo", "train.steps=4", "optim.warmup_steps=1", "federation.every=2"]
        main += ["train.log_every=2"]
        mfu += ["--model", "llama_tiny", "--seq", "32", "--batch", "1", "--dtype", "float32", "--compile", "false"]
        mfu += ["--warmup", "1", "--steps", "1"]
    else:
        main += ["distributed.backend=nccl"]
        mfu += ["--model", "llama3_2_1b", "--seq", "2048", "--batch", "4", "--dtype", "bfloat16", "--compile", "true"]
    return [
        Step("main", main, 150),
        Step("mfu", mfu, 240),
        Step("bf16", [*gpu, "bf16"], 150),
        Step("checkpoint", [*gpu, "checkpoint"], 240),
        Step("hub", [*gpu, "hub"], 240),
        Step("rest", [*gpu, ",".join(REST)], 600),
    ]


# ---------------------------------------------------------------------- prepare (a CPU machine with pip)
def prepare(wheels: Path, py: str, data: Path) -> list[str]:
    """Fill ``wheels`` (emptied first: one version of each) with :data:`WHEELS` at this machine's versions for
    CPython 3.12 manylinux x86_64, and copy ``data`` (``../shared/data``) beside it; the lines to print."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pins = {name: f"{name}=={version(name)}" for name in WHEELS}
    except PackageNotFoundError as exc:
        raise Stop(f"{exc.name} is not installed here: install the project first (README), then --prepare") from exc
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    binary = [pins[n] for n in WHEELS if n not in SDIST_ONLY]
    target = ["--python-version", "3.12", "--implementation", "cp", *[x for p in PLATFORMS for x in ("--platform", p)]]
    pip = [py, "-m", "pip", "-q", "--disable-pip-version-check"]
    calls = [[*pip, "download", "--no-deps", "--only-binary=:all:", *target, "-d", str(wheels), *binary]]
    calls += [[*pip, "wheel", "--no-deps", "-w", str(wheels), pins[n]] for n in WHEELS if n in SDIST_ONLY]
    for argv in calls:
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            last = [x for x in done.stderr.splitlines() if x.strip()] or ["no output"]
            raise Stop(f"pip could not fetch the wheelhouse ({last[-1][:200]}): --prepare needs pip and PyPI")
    size = sum(p.stat().st_size for p in wheels.iterdir())
    if size > WHEELHOUSE_LIMIT:
        raise Stop(f"the wheelhouse is {size / 2**20:.1f} MiB, over the 64 MiB a GPU call carries")
    lines = [f"wheelhouse {wheels}: {len(list(wheels.iterdir()))} wheels, {size / 2**20:.1f} MiB"]
    if data.is_dir():  # the README's data sets (data=text data.path=.gpu/data/...); ../shared does not travel
        shutil.copytree(data, wheels.parent / "data", dirs_exist_ok=True)
        lines.append(f"data: {data} copied to {wheels.parent / 'data'}")
    else:
        lines.append(f"data: no {data} here, none copied (--data DIR)")
    return lines + [f"carry {wheels.parent.relative_to(REPO)} to the GPU machine, then run tools/gpu_run.sh there"]


# ---------------------------------------------------------------------- the run (the GPU machine, or --cpu)
def require_gpu(py: str) -> str:
    """The GPU's name, or :class:`Stop` when this machine's torch sees none."""
    probe = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
    done = subprocess.run([py, "-c", probe], capture_output=True, text=True)
    name = done.stdout.strip()
    if done.returncode != 0:
        last = [x for x in done.stderr.splitlines() if x.strip()] or ["no output"]
        raise Stop(f"torch does not import with {py} ({last[-1][:200]}): run on the machine's own Python")
    if not name:
        raise Stop(
            "no CUDA device on this machine (torch.cuda.is_available() is False): run tools/gpu_run.sh on the "
            "GPU machine, or tools/gpu_run.sh --cpu for the dry run on this CPU"
        )
    return name


def install(wheels: Path, site: Path, py: str) -> str:
    """Install the wheelhouse offline into ``site`` (no dependencies resolved: it holds them all); what was done."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return f"wheelhouse {wheels}: none (this machine's own packages only)"
    argv = [py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir"]
    done = subprocess.run([*argv, "--upgrade", "--target", str(site), *map(str, files)], capture_output=True, text=True)
    if done.returncode != 0:
        last = [x for x in done.stderr.splitlines() if x.strip()] or ["no output"]
        raise Stop(f"the wheelhouse {wheels} did not install into {site}: {last[-1][:200]}")
    return f"wheelhouse {wheels}: {len(files)} wheels installed into {site}"


def check_imports(py: str, env: dict, wheels: Path) -> None:
    """:class:`Stop` naming every distribution whose module does not import with ``env`` (the steps' own)."""
    code = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    try: importlib.import_module(m)\n"
        "    except Exception as e: print(m, type(e).__name__)\n"
    )
    done = subprocess.run([py, "-c", code, *IMPORTS], env=env, capture_output=True, text=True, cwd=REPO)
    missing = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    if done.returncode != 0 or missing:
        names = ", ".join(f"{IMPORTS.get(m, m)} (import {m})" for m in missing) or "python did not start"
        raise Stop(
            f"missing on this machine and in the wheelhouse {wheels}: {names}; run tools/gpu_run.sh --prepare "
            "on a machine with pip and carry .gpu"
        )


def run_env(site: Path, cache: Path) -> dict:
    """The steps' environment: the wheels' folder and this checkout first on the path, the compile caches shared
    by every step (bench.mfu's compiled kernels serve the later steps), W&B offline, output unbuffered."""
    path = [str(site), str(REPO), *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
    }


def stop(proc: subprocess.Popen, grace: float = 20) -> None:
    """End a step past its timeout: SIGINT to its process group first (a job stops at its next step; bench.gpu's
    ``run_check`` kills the jobs it started in process groups of their own), SIGKILL after ``grace`` seconds."""
    for sig, wait in ((signal.SIGINT, grace), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_step(step: Step, env: dict, out: Path, index: int, left: float) -> str:
    """Run ``step`` within its timeout and the time ``left``, its output to ``out/<index>_<name>.log``; one line."""
    if left < 20:
        return f"SKIP {step.name}: no time left in the budget"
    timeout = min(step.timeout_s, int(left))
    log = out / f"{index}_{step.name}.log"
    start = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            step.argv, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop(proc)
            code = None
    took = time.monotonic() - start
    tail = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    if code is None:
        return f"FAIL {step.name}: timed out after {timeout} s (log {log.name})"
    status = "PASS" if code == 0 else "FAIL"
    return f"{status} {step.name}: exit {code} in {took:.0f} s: {(tail or ['no output'])[-1][:300]}"


def chosen(names: str | None, every: list[Step]) -> list[Step]:
    """The steps named in ``names`` (comma-separated, in priority order whatever their order there), or all;
    :class:`Stop` for a name that is no step."""
    if not names:
        return every
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = sorted(wanted - {s.name for s in every})
    if unknown:
        raise Stop(f"no step named {', '.join(unknown)}: --steps takes {','.join(s.name for s in every)}")
    return [s for s in every if s.name in wanted]


def run(args: argparse.Namespace) -> int:
    py = sys.executable
    out = Path(args.out or os.environ.get("OUT") or REPO / "outputs" / "gpu_run" / time.strftime("%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    scratch, started = Path(args.scratch), time.monotonic()
    device = "cpu (dry run)" if args.cpu else require_gpu(py)
    wheels = Path(args.wheels)
    lines = [f"device: {device}"]
    if args.cpu:
        lines.append(f"wheelhouse {wheels}: not installed (the dry run uses this machine's packages)")
    else:
        lines.append(install(wheels, scratch / "site", py))
    env = run_env(scratch / "site", scratch / "cache")
    check_imports(py, env, wheels)
    failed = 0
    report = out / "gpu_run.txt"
    for line in lines:
        print(line, flush=True)
    for index, step in enumerate(chosen(args.steps, steps(args.cpu, py, scratch / f"runs-{os.getpid()}")), 1):
        line = run_step(step, env, out, index, args.budget - (time.monotonic() - started))
        failed += line.startswith("FAIL")
        lines.append(line)
        print(line, flush=True)
        report.write_text("\n".join(lines) + "\n")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/gpu_run.sh", description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--prepare", action="store_true", help="build the wheelhouse here (a CPU machine with pip)")
    mode.add_argument("--cpu", action="store_true", help="the dry run on this CPU: llama_tiny, gloo, a few steps")
    parser.add_argument("--out", default=None, help="where the logs go (default $OUT, else outputs/gpu_run/<time>)")
    parser.add_argument("--wheels", default=str(GPU_DIR / "wheels"), help="the wheelhouse (default .gpu/wheels)")
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data"), help="copied by --prepare")
    parser.add_argument("--scratch", default="/tmp/xffl-gpu-run", help="run dirs, the wheels' target, the caches")
    parser.add_argument("--steps", default=None, help="only these steps, comma-separated (a rerun of what failed)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, help=f"seconds for all steps (default {BUDGET_S})")
    args = parser.parse_args(argv)
    try:
        if args.prepare:
            print("\n".join(prepare(Path(args.wheels), sys.executable, Path(args.data))))
            return 0
        return run(args)
    except Stop as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
