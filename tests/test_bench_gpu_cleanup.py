"""``bench.gpu`` fails loudly and cleans up (issue 40 item 3): a check that raises anything is one ``FAIL`` line,
the next check still runs, and every process the check started (and theirs) is killed."""

from __future__ import annotations

import os
import sys
import time

from xffl_like.bench import gpu as G
from xffl_like.bench.children import spawn

#: A child that starts a grandchild (same process group), writes its pid, and both sleep.
PARENT = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(g.pid))
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: /proc says so
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _gone(pid: int, within: float = 30.0) -> bool:
    end = time.monotonic() + within
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_check_that_raises_fails_in_one_line_and_kills_its_children(tmp_path, monkeypatch):
    started = {}

    def boom(tmp):
        marker = tmp_path / "grandchild.pid"
        started["child"] = spawn([sys.executable, "-c", PARENT, str(marker)]).pid
        end = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()) and time.monotonic() < end:
            time.sleep(0.05)
        started["grandchild"] = int(marker.read_text())
        raise RuntimeError("the hub exited (1) before serving\nsecond line")

    monkeypatch.setitem(G.CHECKS, "boom", boom)
    result = G.run_check("boom", tmp_path)
    assert result.status == "FAIL" and "\n" not in result.line()
    assert result.figure == "RuntimeError: the hub exited (1) before serving second line"
    assert _gone(started["child"]) and _gone(started["grandchild"])


def test_bench_gpu_goes_on_after_a_check_that_raises(monkeypatch, capsys):
    class Odd(Exception):
        pass

    def raises(tmp):
        raise Odd("not a JobError")

    monkeypatch.setitem(G.CHECKS, "first", raises)
    monkeypatch.setitem(G.CHECKS, "second", lambda tmp: G.Result("second", "PASS", "ran"))
    monkeypatch.setattr(G, "gpus", lambda: 1)
    assert G.main(["--only", "first,second"]) == 1
    assert capsys.readouterr().out.splitlines() == ["FAIL first: Odd: not a JobError", "PASS second: ran"]
