"""``$XFFL_TEST_WAIT_NOTICE_S=S``: a process at a rendezvous prints its "waiting for N more processes" notice
after ``S`` seconds instead of :data:`xffl_like.job.WAIT_NOTICE_S` (5 s), so that the test of that notice
waits for it a shorter time (what it says and that the process waits on are the test's, not when).

The seam: the module attribute ``xffl_like.job.WAIT_NOTICE_S``, read when the notice's timer is made.
"""

from __future__ import annotations

import os

from patch_on_import import after_import

ENV = "XFFL_TEST_WAIT_NOTICE_S"


def _shorter(job) -> None:
    job.WAIT_NOTICE_S = float(os.environ[ENV])


if os.environ.get(ENV):
    after_import("xffl_like.job", _shorter)
