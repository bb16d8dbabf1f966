"""The hub's durability against its own disk and its own facilities (issue 38, classes 5 and 6): a commit is
computed aside, saved, and only then served, so a full disk changes nothing anyone sees; no spool file outlives
its round; one hub at a time on a ``--state``; no symbolic link in it followed; the whole state file checksummed
and its sizes checked; a slow reader never holds a commit; a facility whose hub was restarted ``--fresh`` stops
in one line instead of missing every round and exiting 0."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from helpers import REPO
from helpers.hub import ENV, GEOMETRY, SPEC, Facility, Hub, free_port, wait_for

from xffl_like.federation.elastic import ElasticError
from xffl_like.hub.client import HubLink
from xffl_like.hub.protocol.messages import ArriveRequest, JoinRequest, ResultHeader, ResultRequest, UploadHeader
from xffl_like.hub.protocol.wire import GRPC_OPTIONS, Frames, frames_of
from xffl_like.hub.server import store
from xffl_like.hub.server.auth import IdentityInterceptor
from xffl_like.hub.server.errors import HubError
from xffl_like.hub.server.federation import HubFederation
from xffl_like.hub.server.service import HubService

THETA = torch.arange(6, dtype=torch.float32)


def _full(*_args, **_kw):
    raise OSError(errno.ENOSPC, "No space left on device", "state-0000000001.safetensors")


def _join(fed: HubFederation, name: str) -> str:
    session = f"session-{name}"
    fed.join(name, JoinRequest.from_json({"spec": SPEC, "session": session, "geometry": GEOMETRY, "every": 2,
                                          "steps": 20}))  # fmt: skip
    return session


def _frames(session: str, theta: torch.Tensor, kind: str = "create", rid: int | None = None) -> Frames:
    header = UploadHeader(session, kind, round=rid).to_json()
    return Frames(frames_of(header, theta), 4 * theta.numel(), UploadHeader)


def _federation(tmp_path: Path) -> tuple[HubFederation, list[str], dict[str, str]]:
    """A federation of members a (its creator, θ_global = THETA) and b; the hub's log lines."""
    lines: list[str] = []
    fed = HubFederation(tmp_path / "state", None, log=lines.append)
    sessions = {"a": _join(fed, "a")}
    fed.create("a", _frames(sessions["a"], THETA.clone()))
    sessions["b"] = _join(fed, "b")
    return fed, lines, sessions


def _round(fed, sessions, step: int, uploads: dict[str, torch.Tensor]) -> dict[str, tuple[ResultHeader, torch.Tensor]]:
    """Every member arrives at ``step``; those in ``uploads`` upload theirs; each one's result (header, θ)."""
    rids = {}
    for n, s in sessions.items():
        out = fed.arrive(n, ArriveRequest(s, fed.version, step, 2, 32.0))
        rids[n] = out.round
        if n in uploads and out.action == "upload":
            fed.upload(n, _frames(s, uploads[n], "round", out.round))
    results = {}
    for n, s in sessions.items():
        frames = Frames(fed.result(n, ResultRequest(s, rids[n]), lambda: True), 24, ResultHeader)
        results[n] = (frames.header, frames.into(torch.empty(6)))
    return results


# ---------------------------------------------------------------------------------------------- atomic commits
def test_a_commit_that_cannot_be_saved_changes_nothing_anyone_sees(tmp_path, monkeypatch):
    """Disk full at the save: θ_global, the version and what Fetch serves stay the saved version's; each member
    hears a well-formed "missed" with the reason; the hub's log says so in one line; the next round commits."""
    fed, lines, sessions = _federation(tmp_path)
    try:
        monkeypatch.setattr(fed.store, "save", _full)
        monkeypatch.setattr(store.Pending, "finish", _full)  # a version folded ahead is saved there
        results = _round(fed, sessions, 2, {"a": THETA + 1, "b": THETA + 3})
        for header, theta in results.values():
            assert header.status == "missed" and "No space left on device" in header.reason
            assert header.version == 0 and torch.equal(theta, THETA)
        assert fed.version == 0 and torch.equal(fed.theta, THETA)
        fetched = Frames(fed.fetch("b", SimpleNamespace(session=sessions["b"])), 24, ResultHeader)
        assert fetched.header.version == 0 and torch.equal(fetched.into(torch.empty(6)), THETA)
        said = [line for line in lines if "No space left" in line]
        assert len(said) == 1 and "keeps version 0" in said[0] and "free space" in said[0], lines
        monkeypatch.undo()  # nothing committed: the federation's step is still 2, and the round there commits
        results = _round(fed, sessions, 2, {"a": THETA + 1, "b": THETA + 3})
        assert {h.status for h, _ in results.values()} == {"accepted"} and fed.version == 1
        assert all(torch.equal(t, THETA + 2) for _, t in results.values())
        assert store.load_latest(tmp_path / "state").version == 1
    finally:
        fed.close()


def test_a_creation_that_cannot_be_saved_creates_nothing(tmp_path, monkeypatch):
    """Disk full at the creation: refused in one line (INTERNAL), nothing created or said to be; the next
    join creates it."""
    lines: list[str] = []
    fed = HubFederation(tmp_path / "state", None, log=lines.append)
    try:
        session = _join(fed, "a")
        monkeypatch.setattr(fed.store, "save", _full)
        with pytest.raises(HubError) as refused:
            fed.create("a", _frames(session, THETA.clone()))
        assert refused.value.code == "INTERNAL" and "No space left on device" in str(refused.value)
        assert fed.snap is None and fed.spec is None and not any("created" in line for line in lines), lines
        monkeypatch.undo()
        assert fed.join("a", JoinRequest.from_json({"spec": SPEC, "session": session, "geometry": GEOMETRY,
                                                    "every": 2, "steps": 20})).status == "create"  # fmt: skip
    finally:
        fed.close()


def _serve(fed: HubFederation):
    """``fed`` behind a real gRPC server (--insecure) on a free localhost port; (server, address, service)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), interceptors=[IdentityInterceptor(None)],
                         options=GRPC_OPTIONS)  # fmt: skip
    service = HubService(fed)
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}", service


def _link(address: str, name: str) -> HubLink:
    cfg = SimpleNamespace(hub=address, cert=None, ca=None, key=None, timeout_s=20.0)
    return HubLink(cfg, name, SPEC, GEOMETRY, steps=20, every=2)


def _joined(tmp_path: Path, address: str) -> dict[str, HubLink]:
    links = {n: _link(address, n) for n in ("a", "b")}
    (tmp_path / "mine").write_bytes(THETA.numpy().tobytes())
    for n, link in links.items():
        link.join(tmp_path / "mine", tmp_path / f"theta-{n}", 0, 1)
    return links


def test_members_hear_a_failed_commit_as_a_missed_round_over_the_wire(tmp_path, monkeypatch):
    fed = HubFederation(tmp_path / "state", None, log=lambda _: None)
    server, address, _ = _serve(fed)
    links = _joined(tmp_path, address)
    try:
        monkeypatch.setattr(fed.store, "save", _full)
        monkeypatch.setattr(store.Pending, "finish", _full)  # a version folded ahead is saved there
        out = {}

        def round_of(n):
            out[n] = links[n].round(tmp_path / "mine", tmp_path / f"theta-{n}", 2, 32.0, taken=2)

        threads = [threading.Thread(target=round_of, args=(n,)) for n in links]
        [t.start() for t in threads]
        [t.join(timeout=60) for t in threads]
        for n in links:
            assert out[n]["status"] == "missed" and "No space left on device" in out[n]["reason"], out[n]
            assert links[n].version == 0
    finally:
        for link in links.values():
            link.leave()
        server.stop(0)
        fed.close()


# ---------------------------------------------------------------------------------------------- the spool
def test_no_spool_file_outlives_its_round(tmp_path):
    """A rejected upload's file (not finite), a broken one's, and none at all for one refused for its claims."""
    fed, _, sessions = _federation(tmp_path)
    try:
        spool = tmp_path / "state" / "spool"
        c = sessions["c"] = _join(fed, "c")
        d = _join(fed, "d")  # arrives, then its upload breaks off
        for n, s in sessions.items():
            fed.arrive(n, ArriveRequest(s, 0, 2, 2, 32.0 if n != "c" else 1e9))  # c: more tokens than it can hold
        rid = fed.arrive("d", ArriveRequest(d, 0, 2, 2, 32.0)).round
        with pytest.raises(HubError, match="no upload pending"):
            fed.upload("c", _frames(c, THETA.clone(), "round", rid))
        fed.upload("a", _frames(sessions["a"], THETA + 1, "round", rid))
        fed.upload("b", _frames(sessions["b"], torch.full((6,), float("nan")), "round", rid))
        broken = Frames(iter([UploadHeader(d, "round", round=rid, nbytes=24).encode(), b"\0" * 8]), 24, UploadHeader)
        assert not fed.upload("d", broken).ok
        header = Frames(fed.result("b", ResultRequest(sessions["b"], rid), lambda: True), 24, ResultHeader).header
        assert header.status == "rejected" and header.committed
        assert list(spool.iterdir()) == []
    finally:
        fed.close()


# ---------------------------------------------------------------------------------------------- the state directory
def test_a_second_hub_on_the_same_state_is_refused_in_one_line(tmp_path):
    first = Hub(tmp_path)
    try:
        cmd = [sys.executable, "-m", "xffl_like.hub", "serve", "--port", str(free_port()), "--state",
               str(first.state), "--insecure"]  # fmt: skip
        second = subprocess.run(cmd, cwd=REPO, env={**os.environ, **ENV}, capture_output=True,
                                text=True, timeout=120)  # fmt: skip
        assert second.returncode == 2, second.stdout + second.stderr
        line = second.stderr.strip()
        assert "\n" not in line and f"held by another hub (pid {first.proc.pid})" in line and "another --state" in line
        assert first.proc.poll() is None and (first.state / "spool").is_dir()
    finally:
        first.stop()


def test_symbolic_links_in_the_state_are_refused_not_followed(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("keep")
    state = tmp_path / "state"
    state.mkdir()
    (state / "spool").symlink_to(elsewhere)
    with pytest.raises(store.StateError, match="spool is a symbolic link"):
        store.SafetensorsStore(state, log=lambda _: None).open(False)
    with pytest.raises(store.StateError, match="symbolic link"):
        HubFederation(state, None, log=lambda _: None)
    assert (elsewhere / "precious").read_text() == "keep" and (state / "spool").is_symlink()
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "state-0000000001.safetensors").symlink_to(_saved(elsewhere))  # a state file elsewhere
    with pytest.raises(store.StateError, match="state-0000000001.safetensors is a symbolic link"):
        store.SafetensorsStore(linked, log=lambda _: None).open(False)


def _saved(tmp_path: Path, theta: torch.Tensor = THETA) -> Path:
    tmp_path.mkdir(exist_ok=True)
    return store.save(tmp_path, store.Snapshot(0, SPEC, theta.clone()))


def test_the_state_files_metadata_is_checksummed(tmp_path):
    path = _saved(tmp_path)
    raw = path.read_bytes()
    assert raw.count(b'\\"progress\\": 0') == 1
    path.write_bytes(raw.replace(b'\\"progress\\": 0', b'\\"progress\\": 9'))  # one flipped digit of the metadata
    with pytest.raises(store.StateError, match="checksum of its metadata"):
        store.load_latest(tmp_path)


def test_a_theta_of_the_wrong_size_or_missing_keys_are_refused_in_one_line(tmp_path):
    _saved(tmp_path / "small", torch.zeros(5))
    with pytest.raises(store.StateError, match=r"theta has shape \[5\], the federation's description gives \[6\]"):
        store.load_latest(tmp_path / "small")
    path = _saved(tmp_path / "keys")
    meta = {"format": "xffl-hub-1", "version": 0, "spec": SPEC, "crc32": {"theta": store._crc(THETA)}}
    with open(path, "wb") as fh:
        store._write_safetensors(fh, {"theta": THETA.clone()}, {"xffl": json.dumps(meta)})
    with pytest.raises(store.StateError) as refused:
        store.load_latest(tmp_path / "keys")
    assert "lacks 'outer_steps'" in str(refused.value) and "\n" not in str(refused.value)


# ---------------------------------------------------------------------------------------------- readers
def test_a_stalled_reader_holds_no_commit_and_reads_the_version_it_was_told(tmp_path):
    """A Fetch read only up to its header, then left: the round still commits; the stalled reader then gets
    the θ_global of the version its header names, not the one committed meanwhile."""
    fed, _, sessions = _federation(tmp_path)
    try:
        stalled = fed.fetch("b", SimpleNamespace(session=sessions["b"]))
        header = ResultHeader.decode(next(stalled))
        done = threading.Event()
        threading.Thread(target=lambda: (_round(fed, sessions, 2, {"a": THETA + 1, "b": THETA + 3}), done.set()),
                         daemon=True).start()  # fmt: skip
        assert done.wait(60), "the commit waited for a reader that stalled"
        assert fed.version == 1 and header.version == 0
        assert torch.equal(torch.frombuffer(bytearray(b"".join(stalled)), dtype=torch.float32), THETA)
    finally:
        fed.close()


# ---------------------------------------------------------------------------------------------- --fresh mid-run
def test_a_facility_whose_hub_was_started_fresh_stops_in_one_line(tmp_path):
    """The hub restarted with --fresh under running facilities: their next round does not miss silently
    (every round, then "done" and exit 0) but stops in one line naming --fresh, whether the new hub holds no
    federation yet or one another facility created."""
    fed = HubFederation(tmp_path / "state", None, log=lambda _: None)
    server, address, service = _serve(fed)
    links = _joined(tmp_path, address)
    fresh = service.fed = HubFederation(tmp_path / "fresh", None, log=lambda _: None)
    try:
        with pytest.raises(ElasticError) as stopped:
            links["a"].round(tmp_path / "mine", tmp_path / "theta-a", 2, 32.0, taken=2)
        line = str(stopped.value)
        assert "\n" not in line and "no longer holds the federation" in line and "--fresh" in line
        assert "holds no federation yet" in line
        fresh.creator = None  # a's rejoin was the creator; c creates the new federation instead
        fresh.create("c", _frames(_join(fresh, "c"), THETA.clone()))
        with pytest.raises(ElasticError, match="holds another federation, at version 0"):
            links["b"].round(tmp_path / "mine", tmp_path / "theta-b", 2, 32.0, taken=2)
    finally:
        for link in links.values():
            link.leave()
        server.stop(0)
        fed.close()
        fresh.close()


@pytest.mark.slow
def test_a_job_whose_hub_is_restarted_fresh_exits_non_zero_in_one_line(tmp_path):
    """The whole job: its hub restarted --fresh between two of its rounds; it neither misses every round nor
    exits 0 "done", but stops non-zero with the line naming --fresh."""
    hub = Hub(tmp_path)
    go = tmp_path / "go"
    base = ["train.steps=40", "federation.every=2", "optim.warmup_steps=2"]
    f = Facility("a", hub, tmp_path, base=base, env={"XFFL_TEST_ELASTIC_HOLD": f"2:{go}"})
    try:
        wait_for(lambda: any((f.dump / "a").glob("round-0002-*.pt")) or f.proc.poll() is not None, 240, "version 2")
        assert f.proc.poll() is None, f.wait()[1]
        hub.kill()
        hub.extra = ["--fresh"]
        hub.start()
        time.sleep(8)  # its link reconnects (gRPC backs off between attempts)
        go.touch()
        rc, out = f.wait(240)
    finally:
        f.kill()
        hub.stop()
    assert rc != 0 and "no longer holds the federation" in out and "--fresh" in out, out[-3000:]
    assert "done:" not in out, out[-3000:]
