"""``serve --insecure`` needs no ``cryptography`` (issue 40: a GPU image without it must run the hub check); the
commands that need it say so in one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.hub import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_cryptography(tmp_path) -> dict:
    """An environment where ``import cryptography`` fails, as on a machine without the package."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text("import sys\nsys.modules['cryptography'] = None\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO)])}


def test_serve_insecure_starts_without_cryptography(no_cryptography, tmp_path):
    cmd = [sys.executable, "-m", "xffl_like.hub", "serve", "--insecure", "--port", str(free_port())]
    proc = subprocess.Popen(
        [*cmd, "--state", str(tmp_path / "state")],
        cwd=REPO,
        env=no_cryptography,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = iter(proc.stdout.readline, "")  # "hub: serving on ..." once it listens; ends if it died
        first = next((x for x in lines if x.startswith("hub: serving")), "")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert first.startswith("hub: serving on 127.0.0.1:"), (first, out, err)
    assert proc.returncode == 0 and "Traceback" not in err, err


@pytest.mark.parametrize(
    "args",
    [["init", "{d}/ids", "--facilities", "a"], ["serve", "--port", "1", "--certs", "{d}/ids", "--state", "{d}/s"]],
)
def test_certificate_commands_name_the_missing_package(no_cryptography, tmp_path, args):
    argv = [a.format(d=tmp_path) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "xffl_like.hub", *argv],
        cwd=REPO,
        env=no_cryptography,
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "cryptography" in lines[0] and "pip install cryptography" in lines[0]
