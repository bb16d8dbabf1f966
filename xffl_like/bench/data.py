"""``python -m xffl_like.bench.data``: the cost of making a batch, against a training step.

In one process, side by side: the time ``train_batch`` takes for the synthetic source
(and for the text source with ``--text PATH``) and the time of one training step
(forward, backward, AdamW) of ``--model`` on a batch of the same shape. The goal is a data
path that costs a small fraction of a step: ``data/step`` well below 0.1 (a synthetic
batch of 8 x 256 tokens takes a few ms on one CPU core). Timings stay out of the tests.

    python -m xffl_like.bench.data --seq-len 256 --batch-size 8 --text ../shared/data/tinyshakespeare.txt
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from .. import CONF_DIR
from ..config.schema import DataConfig
from ..data import build_data, validate_data

MODEL_DIR = CONF_DIR / "model"


def _median_seconds(fn, repeats: int) -> float:
    fn(0)  # first call: lazy set-up (chains, corpus) is not a per-batch cost
    times = []
    for i in range(1, repeats + 1):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> list[dict]:
    """Print one line per data source: ms per batch, ms per step, their ratio; return the rows."""
    parser = argparse.ArgumentParser(prog="python -m xffl_like.bench.data", description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--model", default="llama_tiny", help="a conf/model name (vocab_size >= 256)")
    parser.add_argument("--text", default=None, help="a UTF-8 corpus to time the text source on")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # what a worker gets (OMP_NUM_THREADS=1)

    from ..models import LlamaConfig, build_model

    model_cfg = OmegaConf.load(MODEL_DIR / f"{args.model}.yaml")
    model = build_model(LlamaConfig.from_mapping(model_cfg), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    common = dict(
        vocab_size=model_cfg.vocab_size,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=0,
        facility=0,
        num_facilities=2,
        facility_rank=0,
        facility_size=1,
    )
    sources = {"synthetic": build_data(DataConfig(name="synthetic", num_eval_batches=1, non_iid=0.5), **common)}
    if args.text:
        text = DataConfig(name="text", path=str(Path(args.text).resolve()), num_eval_batches=1)
        validate_data(text, vocab_size=model_cfg.vocab_size, seq_len=args.seq_len)  # the sources do not check
        sources["text"] = build_data(text, **common)
    batch = sources["synthetic"].train_batch(0)

    def step(_):
        inputs, targets = batch
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step_s = _median_seconds(step, max(3, args.repeats // 4))
    rows = []
    print(f"model {args.model}, batch {args.batch_size} x {args.seq_len} tokens, 1 thread; medians of {args.repeats}")
    for name, source in sources.items():
        data_s = _median_seconds(source.train_batch, args.repeats)
        rows.append(
            {"source": name, "batch_ms": data_s * 1e3, "step_ms": step_s * 1e3, "data_per_step": data_s / step_s}
        )
        print(f"{name:<10} {data_s * 1e3:8.2f} ms/batch  {step_s * 1e3:8.1f} ms/step  data/step {data_s / step_s:.3f}")
    return rows


def cli() -> None:
    """The ``xffl-bench-data`` command: :func:`main`, whose rows are not an exit status."""
    main()


if __name__ == "__main__":
    cli()
