"""The phase table's checks shared by the tests of every mode."""

from __future__ import annotations


def phases_cover_the_loop(summary: dict, within: float = 0.05) -> None:
    """Every rank's phases (summary.json) add up to its training loop's seconds, within ``within`` of them: no
    second of the loop (a wait, an evaluation, a checkpoint) is left out of the phase table."""
    seconds = summary["train_seconds"]
    for rank, row in summary["phases"]["per_rank"].items():
        total = sum(v["total_s"] for v in row.values())
        assert abs(total - seconds) <= within * seconds, (rank, total, seconds, row)
