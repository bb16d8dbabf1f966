"""Test-only faults of a facility's link to the hub (:class:`xffl_like.hub.client.HubLink`), each acting only when
its variable is set:

- ``$XFFL_TEST_HUB_SCALE=S``: the parameters this facility uploads to a round are its own times S (a facility
  whose update is far off, for the hub's norm check);
- ``$XFFL_TEST_HUB_TOKENS=T``: it claims T tokens at every round (a facility that lies, for the hub's claims
  check);
- ``$XFFL_TEST_ELASTIC_PAUSE=ROUND:FILE``: after uploading its contribution to version ROUND's round, the leader
  writes its pid to FILE and waits there 120 s (for the test to kill its facility mid-round).

They wrap the link's seams (:meth:`~xffl_like.hub.client.HubLink.claim`,
:meth:`~xffl_like.hub.client.HubLink.upload_round`) when :mod:`xffl_like.hub.client` is first imported
(:func:`patch_on_import.after_import`), so nothing is imported into a process that never loads it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from patch_on_import import after_import

_VARIABLES = ("XFFL_TEST_HUB_SCALE", "XFFL_TEST_HUB_TOKENS", "XFFL_TEST_ELASTIC_PAUSE")


def _patch(module) -> None:
    link = module.HubLink
    claim, upload_round = link.claim, link.upload_round
    scale, tokens = os.environ.get("XFFL_TEST_HUB_SCALE"), os.environ.get("XFFL_TEST_HUB_TOKENS")
    pause = os.environ.get("XFFL_TEST_ELASTIC_PAUSE")

    def lying_claim(self, claimed: float) -> float:
        return float(tokens) if tokens else claim(self, claimed)

    def faulty_upload(self, path: Path, rid: int, parameters: bool) -> None:
        if scale and parameters:
            import numpy as np

            values = np.fromfile(path, dtype=np.float32)
            (values * np.float32(scale)).tofile(path)
        version = self.version
        upload_round(self, path, rid, parameters)
        if pause and int(pause.split(":", 1)[0]) == version:
            Path(pause.split(":", 1)[1]).write_text(str(os.getpid()))
            time.sleep(120)

    link.claim, link.upload_round = lying_claim, faulty_upload


if any(os.environ.get(v) for v in _VARIABLES):
    after_import("xffl_like.hub.client", _patch)
