"""Fault injection, for tests and demos only: kill a rank, or poison its weights.

``fault.kill_rank=R fault.at_step=S``: rank R sends itself SIGKILL at the start of step S
(1-based: after S - 1 steps), in the first attempt of the job only, so that an elastic
restart (``distributed.max_restarts``) resumes and finishes. ``fault.nan_rank=R
fault.nan_step=S``: rank R writes a NaN into the first element of its local shards after
step S (in every attempt: a deterministic bad facility). ``fault.slow_facility=F
fault.slow_factor=X``: every rank of facility F sleeps ``X - 1`` times each step's own duration after
it, so its steps take ``X`` times as long (a slower site, reproducibly). All off (null) by default.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch

from ..checkpoint.dcp import restart_count
from ..config.schema import FaultConfig
from ..distributed import signals
from ..distributed.state import to_local

__all__ = ["FaultInjector"]


class FaultInjector:
    """The ``fault`` config section as it applies to rank ``rank``."""

    def __init__(self, fault: FaultConfig, rank: int, facility: int = 0):
        self.kill = fault.kill_rank == rank and restart_count() == 0
        self.kill_step = fault.at_step
        self.nan = fault.nan_rank == rank
        self.nan_step = fault.nan_step
        self.slow = fault.slow_factor - 1.0 if fault.slow_facility == facility else 0.0
        self.step_started = 0.0

    def before_step(self, step: int) -> None:
        """Start of step ``step`` (1-based)."""
        self.step_started = time.perf_counter()
        if self.kill and step == self.kill_step:
            # The time lets a demo measure how long the job takes to notice (kill to exit).
            print(
                f"fault: rank {os.environ.get('RANK', '?')} kills itself at step {step} (t={time.time():.3f})",
                file=sys.stderr,
                flush=True,
            )
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    @torch.no_grad()
    def after_step(self, step: int, model: torch.nn.Module) -> None:
        """End of step ``step`` (1-based), after the optimizer."""
        if self.slow > 0:
            if torch.cuda.is_available() and to_local(next(model.parameters())).is_cuda:
                torch.cuda.synchronize()  # the step's own time, not the time to queue it
            signals.sleep(self.slow * (time.perf_counter() - self.step_started))  # a stop request cuts it
        if self.nan and step == self.nan_step:
            for param in model.parameters():
                local = to_local(param)
                if local.numel():
                    local.view(-1)[0] = float("nan")
                    return
