"""A facility of a hub's federation that is late, deterministically (``ElasticFederation``'s leader, before
it asks the hub for a round):

- ``$XFFL_TEST_ELASTIC_ASKING=FILE``: write FILE (this process's id) when asking for a quorum;
- ``$XFFL_TEST_ELASTIC_HOLD=ROUND:FILE``: before asking for round ROUND's (the federation's version this
  facility holds), wait (up to 300 s) for FILE (another facility asking); several, comma-separated;
- ``$XFFL_TEST_ELASTIC_MARK=DIR``: write ``DIR/held-ROUND`` as a hold for round ROUND begins, and
  ``DIR/asking-ROUND`` as it asks for that round (after any hold): a test waits for these events, not a time.

The seam: the leader's round at the hub, ``ElasticFederation._lead`` (on the leader's thread, after
every rank gathered the parameters into its spool).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from patch_on_import import after_import

ASKING, HOLD, MARK = "XFFL_TEST_ELASTIC_ASKING", "XFFL_TEST_ELASTIC_HOLD", "XFFL_TEST_ELASTIC_MARK"


def mark(what: str, round_index: int) -> None:
    """``$XFFL_TEST_ELASTIC_MARK/<what>-<round_index>``, if the variable is set."""
    marks = os.environ.get(MARK)
    if marks:
        Path(marks).mkdir(parents=True, exist_ok=True)
        Path(marks, f"{what}-{round_index}").write_text(str(os.getpid()))


def hold(round_index: int) -> None:
    """What the two variables ask, before asking the hub for round ``round_index``'s quorum."""
    asking = os.environ.get(ASKING)
    if asking:
        Path(asking).write_text(str(os.getpid()))
    for spec in filter(None, os.environ.get(HOLD, "").split(",")):
        if int(spec.split(":", 1)[0]) == round_index:
            mark("held", round_index)
            deadline = time.time() + 300
            while not Path(spec.split(":", 1)[1]).exists() and time.time() < deadline:
                time.sleep(0.1)
    mark("asking", round_index)


def _hold_before_asking(exchange) -> None:
    lead = exchange.ElasticFederation._lead

    def _lead(self, tokens: float, done: int, joining: bool) -> dict:
        hold(self.round)
        return lead(self, tokens, done, joining)

    exchange.ElasticFederation._lead = _lead


if os.environ.get(ASKING) or os.environ.get(HOLD) or os.environ.get(MARK):
    after_import("xffl_like.federation.elastic.exchange", _hold_before_asking)
