"""Rank 0's progress output: a ``tqdm`` bar on a terminal, plain lines otherwise.

On a TTY the bar (step, loss, tokens/s, steps to the next aggregation, the last one's time,
elapsed and remaining time) is redrawn in place by ``tqdm`` (at most ten times a second, and
always on the last step). Anywhere else (CI, Slurm logs, pipes) it prints one plain line every
``log_every`` steps, plus the first and last step, and one line per aggregation round
that falls on such a step: no carriage returns, no escape sequences.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress", "format_bytes", "steps_to_aggregation", "steps_to_round"]

BAR_WIDTH = 20
REDRAW_S = 0.1  # tqdm's mininterval


def format_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def steps_to_aggregation(step: int, every: int, steps: int) -> int:
    """Steps left until the next aggregation after ``step`` (1-based) is done; 0: it aggregates now.

    Rounds end every ``every`` steps and at the last step.
    """
    if step % every == 0 or step == steps:
        return 0
    return min(every - step % every, steps - step)


def steps_to_round(step: int, steps: int, rounds_at: Callable[[int], bool]) -> int | None:
    """Steps left until the first step ``>= step`` after which ``rounds_at`` says a round (or a
    phase switch) ends; ``None`` when none does before the end of training."""
    for done in range(step, steps + 1):
        if rounds_at(done):
            return done - step
    return None


class Progress:
    """Progress of one job as seen from rank 0. ``tty=None`` asks the stream.

    ``rounds_at(done)`` says whether rounds end after step ``done`` (the federation's own rule:
    phases, fragments, no rounds under ``synchronous``); without it rounds end every ``every``
    steps and at the last (``every=0``: no rounds).
    """

    def __init__(
        self,
        steps: int,
        every: int,
        log_every: int,
        stream: TextIO | None = None,
        tty: bool | None = None,
        facilities: int = 1,
        rounds_at: Callable[[int], bool] | None = None,
    ):
        self.steps, self.every, self.log_every = steps, every, log_every
        if rounds_at is None and every:
            rounds_at = lambda done: steps_to_aggregation(done, every, steps) == 0  # noqa: E731
        self.rounds_at = rounds_at
        self._next_round: int | None = 0  # the next round's step once known (None: no more rounds)
        # Rank 0 knows its own facility's loss; with several facilities, say which one it is.
        self.loss_label = "loss" if facilities == 1 else "loss f0"
        self.stream = stream or sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        self.tty = bool(isatty and isatty()) if tty is None else tty
        self._last_round = ""
        self._bar: tqdm | None = None  # on a TTY, from the first step until close()

    def _due(self, step: int) -> bool:
        return step == 1 or step % self.log_every == 0 or step == self.steps

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        """After optimizer step ``step`` (1-based)."""
        left = self._left(step)
        if self.tty:
            self._draw(step, loss, tokens_per_s, left)
        elif self._due(step):
            nxt = "" if left is None else "aggregating" if left == 0 else f"next aggregation in {left} steps"
            self._print(f"step {step:>5}/{self.steps}  {self.loss_label} {loss:.4f}  {tokens_per_s:,.0f} tok/s  {nxt}")

    def _left(self, step: int) -> int | None:
        """Steps to the next round; found by a scan, then reused until that step has passed (a
        phase switch is itself a round, so a rule that changes at one cannot skip it)."""
        if self.rounds_at is None or self._next_round is None:
            return None
        if self._next_round < step:
            left = steps_to_round(step, self.steps, self.rounds_at)
            self._next_round = None if left is None else step + left
            return left
        return self._next_round - step

    def round(self, record: dict) -> None:
        """After aggregation round ``record`` (with ``algbw_gbps`` and ``busbw_gbps``)."""
        text = (
            f"round {record['round']} (step {record['step']}): {record['seconds'] * 1e3:.2f} ms, "
            f"{format_bytes(record['bytes_per_rank'])} per rank, "
            f"{format_bytes(record['cross_facility_bytes'])} across facilities, "
            f"algbw {record['algbw_gbps']:.3f} GB/s, busbw {record['busbw_gbps']:.3f} GB/s"
        )
        if self.tty:
            self._last_round = f"  last aggregation {record['seconds'] * 1e3:.1f} ms"
        elif self._due(record["step"]):
            self._print(text)

    def print(self, text: str) -> None:
        """A line of its own, below the bar when one is on screen."""
        self.close()
        self._print(text)

    def close(self) -> None:
        """End the bar's line (tqdm draws it a last time), if one is on screen."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _draw(self, step: int, loss: float, tokens_per_s: float, left: int | None) -> None:
        nxt = "" if left is None else "aggregating" if left == 0 else f"aggregation in {left}"
        stats = f"{self.loss_label} {loss:.4f}  {tokens_per_s:,.0f} tok/s  {nxt}{self._last_round}"
        if self._bar is None:  # drawn at once, at this step: no empty bar before the first step
            # ``{desc}`` holds the statistics: tqdm's ``{postfix}`` would prefix them with ", ".
            self._bar = tqdm(
                total=self.steps,
                initial=step,
                desc=stats,
                file=self.stream,
                ascii=".#",
                mininterval=REDRAW_S,
                leave=True,
                bar_format=f"step {{n:>{len(str(self.steps))}}}/{{total_fmt}} [{{bar:{BAR_WIDTH}}}] "
                f"{{desc}}  {{elapsed}}<{{remaining}}",
            )
            return
        self._bar.set_description_str(stats, refresh=False)
        self._bar.update(step - self._bar.n)  # redraws when REDRAW_S has passed
        if step == self.steps:
            self._bar.refresh()

    def _print(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
