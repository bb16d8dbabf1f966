"""Where the local workers' fork server comes from (``xffl_like.distributed.fork_server``).

A launcher with one thread forks the server itself (it has imported torch already: the server then imports only
the rest of its preload list); one with another thread running gets a fresh interpreter, as multiprocessing
starts it. Either way the workers are the server's children and compute the same, neither the server nor a
worker holds what the launcher held open (a forked server closes the descriptors it inherited, as the run
directory's lock must stay the launcher's), and the server leaves with the launcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import PYTHONPATH, REPO

pytestmark = [pytest.mark.multiprocess, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")]


def _probe(tmp_path, *flags) -> dict:
    out = tmp_path / "probe.json"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "workers.fork_probe", str(out), *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("thread", [False, True], ids=["one-thread", "a-thread-running"])
def test_the_server_is_forked_only_from_a_launcher_with_one_thread(tmp_path, thread):
    r = _probe(tmp_path, *(["--thread"] if thread else []))
    if thread:  # a fork would copy that thread's locks: a fresh interpreter runs forkserver's main instead
        assert "from multiprocessing.forkserver import main" in r["server_cmdline"], r["server_cmdline"]
    else:  # the launcher's own copy: its command line
        assert r["server_cmdline"] == r["cmdline"], r["server_cmdline"]
    # The workers are the server's children, and they computed: 1 + 2 on both ranks.
    assert sorted(w["rank"] for w in r["workers"]) == [0, 1]
    assert all(w["parent"] == r["server"] and w["sum"] == 3.0 for w in r["workers"]), r["workers"]
    # Only the launcher held its file; the server left with the launcher.
    assert not [f for f in r["server_files"] if f.endswith(".held")], r["server_files"]
    assert not [f for w in r["workers"] for f in w["files"] if f.endswith(".held")], r["workers"]
    assert _gone(r["server"]), "the fork server outlived its launcher"
