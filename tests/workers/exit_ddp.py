"""A user's torchrun script that ends without ``destroy_process_group`` (test_exit.py).

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 4 tests/workers/exit_ddp.py

Every rank wraps a tiny linear model in :class:`DecentralizedDataParallel` (``ring``), trains
``STEPS`` iterations on its own fixed batch, calls ``global_avg()``, prints the averaged
parameters as one JSON line, and returns: no ``close()``, no ``destroy_process_group``. It must
exit 0 (it aborted 1 run in 6 with "terminate called without an active exception": a gloo thread
releasing global_avg's tensors during interpreter teardown; see ``xffl_like.parallel.runtime``).

The optimizer is a plain SGD step (:class:`SGD`): ``torch.optim``'s first optimizer imports
``torch._dynamo``, which costs seconds per process and whose exit handlers happen to hand the
GIL to that thread before teardown often enough to hide the abort.

Options: ``--steps N`` (default 7), ``--topology NAME`` (default ``ring``).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist

from xffl_like.parallel import DecentralizedDataParallel

STEPS = 7
LR = 0.1
IN, OUT = 3, 2  # nn.Linear(IN, OUT)
BATCH = 4


def init_params() -> tuple[torch.Tensor, torch.Tensor]:
    """Rank 0's initial weight and bias (every copy starts from them)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(IN, OUT)
    return layer.weight.detach().clone(), layer.bias.detach().clone()


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's fixed batch: inputs and targets (a pure function of the rank)."""
    x = torch.linspace(-1, 1, BATCH * IN).reshape(BATCH, IN) + 0.1 * rank
    y = torch.linspace(0, 1, BATCH * OUT).reshape(BATCH, OUT) * (rank + 1)
    return x, y


class SGD:
    """``p -= LR * grad`` on one bucket's ``(name, parameter)`` pairs (what DecentralizedDataParallel
    calls: ``step()`` and ``zero_grad()``)."""

    def __init__(self, named: list[tuple[str, torch.Tensor]]):
        self.params = [p for _, p in named]

    @torch.no_grad()
    def step(self) -> None:
        for p in self.params:
            p.add_(p.grad, alpha=-LR)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--topology", default="ring")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = torch.nn.Linear(IN, OUT)
    weight, bias = init_params()
    with torch.no_grad():  # different on every rank but 0: DecentralizedDataParallel broadcasts rank 0's
        model.weight.copy_(weight + rank)
        model.bias.copy_(bias - rank)
    ddp = DecentralizedDataParallel(model, SGD, topology=args.topology)
    x, y = batch(rank)
    for _ in range(args.steps):
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    ddp.global_avg()
    print(json.dumps({"rank": rank, "weight": model.weight.tolist(), "bias": model.bias.tolist()}), flush=True)
    # ... and the script ends here, as the did: no ddp.close(), no dist.destroy_process_group().


if __name__ == "__main__":
    main()
