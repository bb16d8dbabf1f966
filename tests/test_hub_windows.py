"""The hub's state on disk, a round committed window by window (issue 37, item 3): the windowed outer step is
bitwise the whole-tensor step; a round's next version is the mean and the outer step of the saved one, checked
against numpy; a ``--state`` without room for the next version refuses the round in one line and keeps the
previous version; a hub killed in the middle of writing a version restarts from the previous one and applies
the round once."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO
from helpers.hub import GEOMETRY, small_spec

from xffl_like.config.schema import OuterConfig
from xffl_like.federation.outer import OuterOptimizer, outer_step
from xffl_like.hub.protocol.messages import ArriveRequest, JoinRequest, ResultHeader, ResultRequest, UploadHeader
from xffl_like.hub.protocol.wire import Frames, frames_of
from xffl_like.hub.server import federation as hub_federation
from xffl_like.hub.server import store
from xffl_like.hub.server.federation import HubFederation
from xffl_like.hub.server.fold import UNIT

NUMEL = 3 * UNIT + 12345  # three whole windows of UNIT and a part
LR, MOMENTUM = 0.7, 0.9


def spec(numel: int = NUMEL, outer: str = "nesterov") -> dict:
    """Nesterov (DiLoCo's lr and momentum) or Adam, no norm bound that these updates could meet."""
    out = small_spec(numel, max_norm_ratio=1e6)
    out["outer"] = {**out["outer"], "name": outer, "lr": LR, "momentum": MOMENTUM}
    return out


def theta0(numel: int = NUMEL) -> torch.Tensor:
    return torch.linspace(-1, 1, numel, dtype=torch.float32)


def uploads(step: int, numel: int = NUMEL) -> dict[str, torch.Tensor]:
    """Members a's and b's parameters at ``step`` (fixed, so a test and a killed process agree)."""
    g = torch.Generator().manual_seed(step)
    return {n: theta0(numel) + 0.1 * torch.randn(numel, generator=g) for n in ("a", "b")}


# ---------------------------------------------------------------------------------------------- in one process
def _join(fed: HubFederation, name: str, sp: dict) -> str:
    session = f"session-{name}"
    fed.join(name, JoinRequest.from_json({"spec": sp, "session": session, "geometry": GEOMETRY, "every": 2,
                                          "steps": 20}))  # fmt: skip
    return session


def _frames(session: str, theta: torch.Tensor, kind: str, rid: int | None = None) -> Frames:
    return Frames(frames_of(UploadHeader(session, kind, round=rid).to_json(), theta), 4 * theta.numel(), UploadHeader)


def federation(state: Path, sp: dict, lines: list[str]) -> tuple[HubFederation, dict[str, str]]:
    """A new federation of a (its creator, θ_global = :func:`theta0`) and b, or the one saved in ``state``."""
    snap = store.SafetensorsStore(state, lines.append).open(False) if state.exists() else None
    fed = HubFederation(state, snap, log=lines.append)
    sessions = {"a": _join(fed, "a", sp)}
    if snap is None:
        fed.create("a", _frames(sessions["a"], theta0(numel(sp)), "create"))
    sessions["b"] = _join(fed, "b", sp)
    return fed, sessions


def numel(sp: dict) -> int:
    return sp["parameters"][0][1][0]


def play(fed: HubFederation, sessions: dict[str, str], step: int) -> dict[str, ResultHeader]:
    """Every member arrives at ``step`` and uploads :func:`uploads`; each one's result header."""
    rids, ups = {}, uploads(step, fed.theta.numel())
    for n, s in sessions.items():
        out = fed.arrive(n, ArriveRequest(s, fed.version, step, 2, 32.0))
        rids[n] = out.round
        if out.action == "upload":
            fed.upload(n, _frames(s, ups[n], "round", out.round))
    nbytes = 4 * fed.theta.numel()
    return {n: Frames(fed.result(n, ResultRequest(s, rids[n]), lambda: True), nbytes, ResultHeader).header
            for n, s in sessions.items()}  # fmt: skip


def by_hand(rounds: int, numel: int = NUMEL, outer: str = "nesterov") -> tuple[np.ndarray, np.ndarray]:
    """θ_global and the first outer buffer after ``rounds`` rounds at steps 2, 4, ..., in float64 numpy, on
    ``d = θ - mean``: Nesterov (SGD's rule: ``buf = m buf + d``; ``θ -= lr (d + m buf)``) or Adam (betas 0.9,
    0.99, bias-corrected at the round's step)."""
    theta, buf, v = theta0(numel).double().numpy(), np.zeros(numel), np.zeros(numel)
    for r in range(1, rounds + 1):
        ups = uploads(2 * r, numel)
        d = theta - (ups["a"].double().numpy() + ups["b"].double().numpy()) / 2
        if outer == "adam":
            buf, v = 0.9 * buf + 0.1 * d, 0.99 * v + 0.01 * d * d
            theta = theta - LR / (1 - 0.9**r) * buf / (np.sqrt(v / (1 - 0.99**r)) + 1e-8)
        else:
            buf = MOMENTUM * buf + d
            theta = theta - LR * (d + MOMENTUM * buf)
    return theta, buf


def by_torch(rounds: int, numel: int = NUMEL, outer: str = "nesterov") -> tuple[torch.Tensor, torch.Tensor]:
    """The same rounds as a facility steps them: the whole tensors, fp32 (the mean as the hub sums it)."""
    cfg = OuterConfig(name=outer, lr=LR, momentum=MOMENTUM)
    opt = OuterOptimizer(cfg, theta0(numel))
    for r in range(1, rounds + 1):
        ups = uploads(2 * r, numel)
        mean = torch.zeros(numel).add_(ups["a"], alpha=0.5).add_(ups["b"], alpha=0.5)
        opt.step(torch.sub(opt.theta, mean))
    return opt.theta, next(iter(opt.buffers.values()))


# ---------------------------------------------------------------------------------------------- the windowed step
@pytest.mark.parametrize("name", ["average", "momentum", "nesterov", "adam"])
def test_the_windowed_outer_step_is_bitwise_the_whole_tensors_step(name):
    """Three rounds: windows of :data:`UNIT` values (the hub's) and of an odd size give bitwise the whole-tensor
    step, the step count advanced once per round; the whole-tensor step is numpy's in float64 (Adam: with bias
    correction at the round's step)."""
    cfg = OuterConfig(name=name, lr=LR, momentum=MOMENTUM if name != "average" else 0.0)
    g = torch.Generator().manual_seed(0)
    deltas = [torch.randn(NUMEL, generator=g) for _ in range(3)]
    whole = OuterOptimizer(cfg, theta0())
    for d in deltas:
        whole.step(d.clone())
    assert whole.steps == 3
    for size in (UNIT, 4097):
        theta, buffers = theta0(), {k: torch.zeros(NUMEL) for k in whole.buffers}
        for steps, d in enumerate(deltas, start=1):
            for a in range(0, NUMEL, size):
                outer_step(cfg, steps, theta[a : a + size], {k: v[a : a + size] for k, v in buffers.items()},
                           d[a : a + size].clone())  # fmt: skip
        assert torch.equal(theta, whole.theta) and all(torch.equal(buffers[k], whole.buffers[k]) for k in buffers)
    theta, m, v = theta0().double().numpy(), np.zeros(NUMEL), np.zeros(NUMEL)
    for t, d in enumerate(deltas, start=1):
        d = d.double().numpy()
        if name == "average":
            theta = theta - LR * d
        elif name == "adam":
            m, v = 0.9 * m + 0.1 * d, 0.99 * v + 0.01 * d * d
            theta = theta - LR / (1 - 0.9**t) * m / (np.sqrt(v / (1 - 0.99**t)) + 1e-8)
        else:
            m = MOMENTUM * m + d
            theta = theta - LR * ((d + MOMENTUM * m) if name == "nesterov" else m)
    np.testing.assert_allclose(whole.theta.double().numpy(), theta, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("outer", ["nesterov", "adam"])
def test_rounds_are_committed_window_by_window_from_the_saved_version(tmp_path, monkeypatch, outer):
    """Two rounds over windows of :data:`UNIT` values: each version is numpy's outer step of the mean of the
    saved one (and bitwise a facility's whole-tensor step), its state and step count saved; the hub holds no
    θ_global, outer optimizer or accumulator in memory."""
    monkeypatch.setattr(hub_federation, "window", lambda uploads: UNIT)
    lines: list[str] = []
    fed, sessions = federation(tmp_path / "state", spec(outer=outer), lines)
    try:
        for r in (1, 2):
            assert {h.status for h in play(fed, sessions, 2 * r).values()} == {"accepted"}, lines
            saved = store.load_latest(tmp_path / "state")
            theta, buf = by_hand(r, outer=outer)
            first = saved.buffers["momentum_buffer" if outer == "nesterov" else "exp_avg"]
            assert saved.version == r and saved.outer_steps == r
            tol = 1e-5 if outer == "nesterov" else 1e-3  # Adam: lr x sign(d) where d is at fp32's rounding
            np.testing.assert_allclose(saved.theta.double().numpy(), theta, rtol=tol, atol=tol)
            np.testing.assert_allclose(first.double().numpy(), buf, rtol=tol, atol=tol)
            whole_theta, whole_buf = by_torch(r, outer=outer)
            assert torch.equal(saved.theta, whole_theta) and torch.equal(first, whole_buf)
            assert torch.equal(fed.theta, whole_theta)
        assert not hasattr(fed, "acc") and not hasattr(fed, "outer")
    finally:
        fed.close()


# ---------------------------------------------------------------------------------------------- no room on --state
class Tmpfs:
    """A small tmpfs mounted at ``path`` for the test (root only), unmounted after."""

    def __init__(self, path: Path, mib: int):
        path.mkdir()
        self.path = path
        run = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)], capture_output=True)
        self.mounted = run.returncode == 0

    def close(self):
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def _fill(directory: Path, leave: int) -> Path:
    """A file that leaves ``leave`` bytes free on ``directory``'s filesystem."""
    filler = directory / "filler"
    with open(filler, "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, store.shutil.disk_usage(directory).free - leave)
    return filler


def test_a_state_without_room_for_the_next_version_refuses_the_round(tmp_path, monkeypatch):
    """--state on a small tmpfs (else disk_usage patched): filled until the next version and the margin do not
    fit, the round is refused in one line naming --state and the bytes needed and free, before anything is
    written; the previous version stays, byte for byte; the members hear "missed"; room again, the next round
    commits."""
    disk = Tmpfs(tmp_path / "disk", 80)
    state = disk.path / "state"
    lines: list[str] = []
    fed = None
    try:
        fed, sessions = federation(state, spec(), lines)
        before = (state / "state-0000000000.safetensors").read_bytes()
        size = len(before)
        if disk.mounted:
            filler = _fill(disk.path, store.MARGIN + size // 2)
        else:
            usage = store.shutil.disk_usage(state)
            monkeypatch.setattr(store.shutil, "disk_usage", lambda _: usage._replace(free=store.MARGIN + size // 2))
        results = play(fed, sessions, 2)
        for h in results.values():
            assert h.status == "missed" and h.version == 0 and "--state" in h.reason, h
        said = [line for line in lines if "refused version 1" in line]
        assert len(said) == 1 and "\n" not in said[0] and str(state) in said[0] and "keeps version 0" in said[0]
        free, needs = map(int, re.search(r"has (\d+) bytes free; the next version needs (\d+)", said[0]).groups())
        assert free < needs and needs >= size + store.MARGIN, said[0]
        assert sorted(p.name for p in state.glob("*state-*")) == ["state-0000000000.safetensors"]
        assert (state / "state-0000000000.safetensors").read_bytes() == before and fed.version == 0
        if disk.mounted:
            filler.unlink()
        else:
            monkeypatch.undo()
        # the round at step 2 again: it committed nothing, so it is still the federation's next (rounds keyed by step)
        assert {h.status for h in play(fed, sessions, 2).values()} == {"accepted"} and fed.version == 1
    finally:
        if fed is not None:
            fed.close()
        disk.close()


# ---------------------------------------------------------------------------------------------- killed mid-write
_KILLED = """
import sys, time
sys.path[:0] = [{tests!r}]
from pathlib import Path
from test_hub_windows import federation, play, spec, UNIT
from xffl_like.hub.server import federation as hub_federation
from xffl_like.hub.server import fold

hub_federation.window = lambda uploads: UNIT
done, whole = [0], fold.fold
def slow(*args):
    whole(*args)
    done[0] += 1
    if done[0] == 2:  # half of round 2's windows are in the next version's file
        print("MID", flush=True)
        time.sleep(600)
lines = []
fed, sessions = federation(Path({state!r}), spec(), lines)
play(fed, sessions, 2)
print("ONE", fed.version, flush=True)
fold.fold = slow  # at the close, or folded ahead while the uploads stream in (the committer either way)
play(fed, sessions, 4)
"""


def test_a_hub_killed_while_writing_a_version_restarts_from_the_previous_one(tmp_path):
    """A hub process SIGKILLed with round 2's version half written: on restart version 1 is whole (checksums),
    the partial file is not a version, and round 2 played again commits once (numpy's two rounds, step count 2)."""
    state = tmp_path / "state"
    code = _KILLED.format(tests=str(REPO / "tests"), state=str(state))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        said = [proc.stdout.readline().strip() for _ in range(2)]
        assert said == ["ONE 1", "MID"], said
        assert (state / ".state-0000000002.safetensors.tmp").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    time.sleep(0.1)
    lines: list[str] = []
    fed, sessions = federation(state, spec(), lines)
    try:
        assert fed.version == 1 and store.load_latest(state).outer_steps == 1
        assert {h.status for h in play(fed, sessions, 4).values()} == {"accepted"}, lines
        saved = store.load_latest(state)
        theta, buf = by_hand(2)
        assert saved.version == 2 and saved.outer_steps == 2
        np.testing.assert_allclose(saved.theta.double().numpy(), theta, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(saved.buffers["momentum_buffer"].double().numpy(), buf, rtol=1e-5, atol=1e-5)
        assert sorted(p.name for p in state.glob("*state-*")) == [f"state-000000000{v}.safetensors" for v in (1, 2)]
    finally:
        fed.close()
