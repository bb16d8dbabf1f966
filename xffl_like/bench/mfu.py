"""``python -m xffl_like.bench.mfu``: tokens/s, MFU and peak memory of steady-state training steps.

Model FLOPs utilisation is the FLOPs a step must do by the model's shape, divided by the time it took and the
device's peak. Three parts, each checkable on its own:

- :func:`flops_per_token`: the standard count, ``6 N + 12 L d T`` (:data:`FORMULA`): ``6 N`` for the matrix
  products of the forward (2 N) and backward (4 N) passes over the ``N`` parameters that multiply (every
  parameter but the token embedding, a lookup; the output head counts, tied or not), plus attention's scores
  and weighted sum, ``12 L d T`` per token at sequence length ``T`` (``d = n_heads * head_dim``). Recomputation
  (activation checkpointing) is not counted: MFU, not hardware FLOPs utilisation.
- :func:`peak_flops`: the dense bf16 tensor-core peak from the device's name and SKU (:data:`PEAKS`: H100
  SXM/PCIe/NVL, H200, GH200, A100, ...), or the ``--peak-tflops`` / ``XFFL_PEAK_TFLOPS`` override.
- :func:`measure`: one process trains the job's model as the job does (FSDP2 over one rank, the job's data
  source, AdamW) and times only steady-state steps: ``--warmup`` steps first (compilation, allocator
  warm-up), then ``--steps`` steps between two device synchronisations. Nothing else runs in the window: no
  rounds, checkpoints or evaluations.

``python -m xffl_like.bench.mfu --model llama3_2_1b --seq 2048 --compile both`` prints the formula and
one line per setting (bf16 by default). ``python -m xffl_like.bench.gpu --only mfu_llama3_2_1b`` runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

__all__ = ["FORMULA", "PEAKS", "Measurement", "flops_per_token", "main", "measure", "peak_flops"]

FORMULA = (
    "FLOPs/token = 6*N + 12*L*d*T (N: parameters without the token embedding, head included; "
    "L: layers; d: n_heads*head_dim; T: sequence length)"
)

#: Dense (no sparsity) bf16 tensor-core peak in FLOP/s, by what the device's name contains: the first row whose
#: every word is in the name (case-insensitive) gives the peak; the order puts each SKU before its family.
#: torch names them e.g. "NVIDIA H100 80GB HBM3" (SXM5), "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200",
#: "NVIDIA GH200 480GB", "NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe". NVIDIA's data sheets.
PEAKS: tuple[tuple[str, str, float], ...] = (
    ("GH200", "GH200", 989e12),
    ("H200 NVL", "H200 NVL", 835e12),
    ("H200", "H200 SXM", 989e12),
    ("H100 NVL", "H100 NVL", 835e12),
    ("H100 PCIe", "H100 PCIe", 756e12),
    ("H100", "H100 SXM", 989e12),
    ("B200", "B200", 2250e12),
    ("A100", "A100", 312e12),
    ("L40S", "L40S", 362e12),
    ("A10G", "A10G", 70e12),
    ("A10", "A10", 125e12),
    ("L4", "L4", 121e12),
)


def flops_per_token(shape, seq_len: int) -> tuple[int, int]:
    """(FLOPs per trained token by :data:`FORMULA`, ``N``) for a :class:`~xffl_like.models.LlamaConfig` ``shape``
    at sequence length ``seq_len``. ``N`` is counted from the shape, as the model builds its parameters."""
    d, hd = shape.dim, shape.head_dim
    q, kv = shape.n_heads * hd, shape.n_kv_heads * hd
    block = d * q + 2 * d * kv + q * d + 3 * d * shape.ffn_dim + 2 * d  # wq, wk, wv, wo, w1-3, two norms
    n = shape.n_layers * block + d + shape.vocab_size * d  # + final norm + output head (the tied one too)
    return 6 * n + 12 * shape.n_layers * q * seq_len, n


def peak_flops(name: str | None = None, override_tflops: float | None = None) -> tuple[float, str] | None:
    """(peak FLOP/s, the SKU it is for) of the device called ``name`` (default: CUDA device 0's), or of
    ``override_tflops`` (default ``$XFFL_PEAK_TFLOPS``); ``None`` for a device :data:`PEAKS` does not know."""
    if override_tflops is None and os.environ.get("XFFL_PEAK_TFLOPS"):
        override_tflops = float(os.environ["XFFL_PEAK_TFLOPS"])
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"peak {override_tflops!r} TFLOP/s: must be a positive number (e.g. 989 for an H100 SXM)")
        return override_tflops * 1e12, "override"
    if name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        name = torch.cuda.get_device_name(0)
    words = set(name.upper().replace("-", " ").split())
    for key, sku, flops in PEAKS:
        if all(w in words for w in key.upper().split()):
            return flops, sku
    return None


@dataclass
class Measurement:
    compile: bool
    dtype: str
    device: str
    tokens_per_second: float
    step_seconds: float
    mfu: float | None
    peak_memory_bytes: int  # the device's peak allocated (CUDA), or the process's peak RSS (CPU)
    timed_steps: int

    def line(self, model: str, seq: int, batch: int) -> str:
        mfu = f"MFU {self.mfu:.1%}" if self.mfu is not None else "MFU n/a (unknown peak: --peak-tflops)"
        return (
            f"{model} {self.dtype} seq {seq} batch {batch} compile={str(self.compile).lower()} on {self.device}: "
            f"{self.tokens_per_second:,.0f} tokens/s, {mfu}, peak memory {self.peak_memory_bytes / 2**30:.2f} GiB, "
            f"{self.step_seconds * 1e3:.1f} ms/step over {self.timed_steps} steady-state steps"
        )


def _job(model: str, seq: int, batch: int, dtype: str, compile_: bool, extra: list[str]):
    """The typed job of one rank training ``model`` (composed and validated as the CLI does)."""
    from pathlib import Path

    from ..config.validate import validate_config
    from ..job import _compose, choices, resolve, typed_config

    overrides = [
        "+experiment=llama_fed",
        "logger=none",
        "distributed.nproc_per_node=1",
        "distributed.federated=null",
        f"model={model}",
        f"train.seq_len={seq}",
        f"train.batch_size={batch}",
        f"train.dtype={dtype}",
        f"train.compile={str(compile_).lower()}",
        "optim.warmup_steps=0",
        *extra,
    ]
    composed = _compose(overrides)
    job = typed_config(resolve(composed), choices(composed))
    return validate_config(job, 1, 1, Path.cwd())


def _training(job, state, compile_: bool, seq: int, batch: int):
    """The sharded model (compiled by block with ``compile_``), its optimizer and its data (prefetched on CUDA)."""
    from ..data import build_data
    from ..train.optim import build_optimizer
    from ..train.parallelize import build_sharded_model
    from ..train.speed import compile_blocks, compute_dtype

    resolved = compute_dtype(job.train.dtype, state.device)
    net = build_sharded_model(job.model, state, resolved, seed=job.seed)
    if compile_:
        compile_blocks(net)
    optimizer = build_optimizer(net, job.optim)
    data = build_data(
        job.data, vocab_size=job.model.vocab_size, seq_len=seq, batch_size=batch, seed=job.seed,
        facility=0, num_facilities=1, facility_rank=0, facility_size=1,
    )  # fmt: skip
    if state.device.type == "cuda":
        from ..data.prefetch import Prefetcher

        data = Prefetcher(data)
    return net, optimizer, data, resolved


def _timed_steps(step, warmup: int, steps: int, device, clock=time.perf_counter) -> float:
    """Seconds of ``steps`` calls of ``step(n)`` after ``warmup`` untimed ones (each waited for to its end):
    ``clock()`` is read once after step ``warmup - 1`` finished and once after step ``warmup + steps - 1``."""
    import torch

    cuda = device.type == "cuda"
    for n in range(warmup):
        loss = step(n)
    float(loss)  # the warm-up's work is done
    if cuda:
        torch.cuda.synchronize(device)
    start = clock()
    for n in range(warmup, warmup + steps):
        loss = step(n)
    float(loss)
    if cuda:
        torch.cuda.synchronize(device)
    return clock() - start


def _fresh_device() -> None:
    """Collect what the last measurement left (FSDP's hooks hold reference cycles), return the cached blocks
    and start the device's peak memory from what is allocated now (CUDA; elsewhere only the collection)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _train_and_time(job, state, compile_: bool, seq: int, batch: int, warmup: int, steps: int):
    """(seconds of the timed steps, peak memory, the compute dtype): the job's model trained as the job updates it
    (gradient clipping by ``optim.grad_clip``, AdamW, zeroing, the schedule: :meth:`ShardedParts.step`). Its
    model, optimizer and data are this function's alone: freed when it returns."""
    import torch

    from ..train.optim import build_scheduler
    from ..train.parallelize import peak_rss_mb
    from ..train.step import accumulate_gradients
    from ..train.sync import ShardedParts

    device = state.device
    net, optimizer, data, resolved = _training(job, state, compile_, seq, batch)
    parts = ShardedParts(net, optimizer, build_scheduler(optimizer, job.optim, warmup + steps), job.optim.grad_clip)

    def step(n: int) -> torch.Tensor:
        loss = accumulate_gradients(parts.model, lambda i: data.train_batch(n), job.train, device)
        parts.step()
        return loss

    try:
        seconds = _timed_steps(step, warmup, steps, device)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else int(peak_rss_mb() * 2**20)
    finally:
        if hasattr(data, "close"):
            data.close()
    return seconds, peak, resolved


def measure(
    model: str = "llama3_2_1b",
    seq: int = 2048,
    batch: int = 4,
    *,
    dtype: str = "auto",
    compile_: bool = False,
    warmup: int = 5,
    steps: int = 20,
    peak_tflops: float | None = None,
    extra: list[str] | None = None,
) -> Measurement:
    """Train ``model`` in this process (a world of one rank; CUDA where there is one) and time ``steps``
    steady-state steps after ``warmup`` steps. Collective-free after setup: FSDP2 over one rank. An earlier
    measurement's model is freed first and its peak memory does not count here (eager, then compiled)."""
    import torch
    import torch.distributed as dist

    from ..distributed.env import ProcessEnv
    from ..distributed.state import build_state
    from ..models import LlamaConfig

    if warmup < 1 or steps < 1:
        raise ValueError(f"--warmup {warmup} --steps {steps}: need at least one of each")
    job, layout = _job(model, seq, batch, dtype, compile_, list(extra or []))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    made_group = not dist.is_initialized()
    if made_group:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        state = build_state(layout, ProcessEnv(0, 1, 0, 1), backend=backend)
        device, cuda = state.device, state.device.type == "cuda"
        _fresh_device()
        seconds, peak_mem, resolved = _train_and_time(job, state, compile_, seq, batch, warmup, steps)
    finally:
        _fresh_device()  # the model, its optimizer state and its cached blocks are gone before the next one
        if made_group:
            dist.destroy_process_group()
    per_token, _ = flops_per_token(LlamaConfig.from_model(job.model), seq)
    tps = steps * batch * seq / seconds
    peak = peak_flops(override_tflops=peak_tflops) if cuda or peak_tflops is not None else None
    return Measurement(
        compile=compile_,
        dtype=resolved,
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        tokens_per_second=tps,
        step_seconds=seconds / steps,
        mfu=per_token * tps / peak[0] if peak else None,
        peak_memory_bytes=int(peak_mem),
        timed_steps=steps,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xffl_like.bench.mfu", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3_2_1b", help="a conf/model name (default llama3_2_1b)")
    parser.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--compile", default="both", choices=["true", "false", "both"])
    parser.add_argument("--warmup", type=int, default=5, help="steps before the timed window (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="steps timed (default 20)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak (default: by its name)")
    parser.add_argument("--json", action="store_true", help="print each measurement as one JSON line")
    parser.add_argument("overrides", nargs="*", help="more Hydra overrides of the job (e.g. train.loss_chunk=512)")
    args = parser.parse_args(argv)
    try:
        from ..models import LlamaConfig

        job, _ = _job(args.model, args.seq, args.batch, args.dtype, False, args.overrides)
        per_token, n = flops_per_token(LlamaConfig.from_model(job.model), args.seq)
        print(f"{FORMULA}: N={n:,}, {per_token / 1e9:.3f} GFLOP/token at T={args.seq}", flush=True)
        peak = peak_flops(override_tflops=args.peak_tflops)
        print(f"peak: {f'{peak[0] / 1e12:.0f} TFLOP/s bf16 dense ({peak[1]})' if peak else 'unknown'}", flush=True)
        settings = {"true": [True], "false": [False], "both": [False, True]}[args.compile]
        for compile_ in settings:
            m = measure(
                args.model, args.seq, args.batch, dtype=args.dtype, compile_=compile_, warmup=args.warmup,
                steps=args.steps, peak_tflops=args.peak_tflops, extra=args.overrides,
            )  # fmt: skip
            print(json.dumps(asdict(m)) if args.json else m.line(args.model, args.seq, args.batch), flush=True)
    except ValueError as exc:  # ConfigError included: one line
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
