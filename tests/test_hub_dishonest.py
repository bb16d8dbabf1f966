"""A member with a valid identity that lies: a raw gRPC client against a real hub server in this process.

Every field from the network is typed and bounded before it touches state (issue 38 item 1), every exception of
a handler is logged and answered in one line with a real status code (item 7), and the smaller findings of the
issue's class 7 (damaged identity files, key permissions, idle connections, plots of missed rounds)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import grpc
import pytest
import torch
from helpers.hub import GEOMETRY, SPEC

from xffl_like.hub.protocol.messages import UploadHeader
from xffl_like.hub.protocol.wire import SERVICE, Frames, frames_of, pack, unpack
from xffl_like.hub.server.auth import IdentityInterceptor
from xffl_like.hub.server.federation import HubFederation
from xffl_like.hub.server.service import HubService

HUGE = [["w", [1 << 20, 1 << 19], "float32"]]  # 2^39 parameters


class _Served:
    """A hub (``--insecure``: names on trust; TLS is not the point here) on a free port in this process, with
    its federation created by facility ``a``; ``logs``: what the hub printed."""

    def __init__(self, state: Path, create: bool = True):
        from concurrent import futures

        self.logs: list[str] = []
        self.fed = HubFederation(state, None, log=self.logs.append)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                                  interceptors=[IdentityInterceptor(None, log=self.logs.append)])  # fmt: skip
        self.server.add_generic_rpc_handlers((HubService(self.fed).handler(),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        if not create:
            return
        self.join("a", "session-a")
        theta = torch.arange(6, dtype=torch.float32)
        header = UploadHeader("session-a", "create", facility="a").to_json()
        self.fed.create("a", Frames(frames_of(header, theta), 24, UploadHeader))

    def raw(self, method: str, data: bytes):
        return self.channel.unary_unary(f"/{SERVICE}/{method}")(data, timeout=30)

    def call(self, method: str, **msg):
        return unpack(self.raw(method, pack(msg)))

    def join(self, name: str, session: str, **changes):
        msg = {"spec": SPEC, "session": session, "geometry": GEOMETRY, "every": 2, "steps": 20, "facility": name}
        return self.call("Join", **{**msg, **changes})

    def state(self):
        """What a refused message must leave as it was."""
        f = self.fed
        return (f.version, f.snap.progress, f.snap.ended, sorted(f.members.members), f.theta.clone().tolist(),
                f.round and dict(f.round.arrivals), f.creator, f.pending_spec)  # fmt: skip

    def close(self):
        self.channel.close()
        self.server.stop(0)
        self.fed.close()


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    served = _Served(tmp_path_factory.mktemp("dishonest") / "state")
    yield served
    served.close()


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    return raised.value


# ------------------------------------------------------------------------------------ 1: one schema, bounded
def _nested(n: int) -> bytes:
    return b'{"session":"x","facility":"m","spec":' + b"[" * n + b"]" * n + b"}"


LIES = {
    "every 5e-324": lambda h: h.join("m", "s-m", every=5e-324),
    "every 'x'": lambda h: h.join("m", "s-m", every="x"),
    "every 0": lambda h: h.join("m", "s-m", every=0),
    "steps -1": lambda h: h.join("m", "s-m", steps=-1),
    "every_s 5e-324": lambda h: h.join("m", "s-m", spec={**SPEC, "every_s": 5e-324}),
    "no parameters": lambda h: h.join("m", "s-m", spec={k: v for k, v in SPEC.items() if k != "parameters"}),
    "parameters [1]": lambda h: h.join("m", "s-m", spec={**SPEC, "parameters": [1]}),
    "2^39 parameters": lambda h: h.join(
        "m", "s-m", spec={**SPEC, "parameters": [["w", [1 << 20, 1 << 19], "float32"]]}
    ),
    "grace_s 1e300": lambda h: h.join("m", "s-m", spec={**SPEC, "grace_s": 1e300}),
    "geometry 2^30": lambda h: h.join("m", "s-m", geometry={**GEOMETRY, "batch_size": 1 << 30}),
    "a 401-digit int": lambda h: h.raw("Join", b'{"session":"s-m","facility":"m","steps":' + b"7" * 401 + b"}"),
    "a 5,000-digit int": lambda h: h.raw("Join", b'{"session":"s-m","facility":"m","steps":' + b"7" * 5000 + b"}"),
    "1e400": lambda h: h.raw("Join", b'{"session":"s-m","facility":"m","steps":1e400}'),
    "100k nested [": lambda h: h.raw("Join", _nested(100_000)),
    "a 1,000-character session": lambda h: h.join("m", "s" * 1000),
    "tokens of 401 digits": lambda h: h.raw(
        "Arrive", b'{"session":"session-a","facility":"a","version":0,"step":2,"taken":2,"tokens":' + b"9" * 401 + b"}"
    ),  # fmt: skip
    "taken 'x'": lambda h: h.call(
        "Arrive", session="session-a", facility="a", version=0, step=2, taken="x", tokens=32.0
    ),  # fmt: skip
    "version 2^70": lambda h: h.call(
        "Arrive", session="session-a", facility="a", version=1 << 70, step=2, taken=2, tokens=32.0
    ),  # fmt: skip
    "round -1": lambda h: h.call("Result", session="session-a", facility="a", round=-1),
}


@pytest.mark.parametrize("lie", list(LIES))
def test_a_field_out_of_its_type_or_bounds_is_refused_before_it_touches_state(hub, lie):
    before = hub.state()
    err = _refused(lambda: LIES[lie](hub))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (lie, err.code(), err.details())
    assert "\n" not in err.details() and "Exception calling application" not in err.details()
    assert hub.state() == before, f"{lie} changed the hub's state"
    # the federation goes on: an honest beat is answered, its view JSON-clean
    assert hub.call("Beat", session="session-a", facility="a")["version"] == hub.fed.version


CREATOR_LIES = {
    "2^39 parameters": {"parameters": HUGE},
    "every_s 5e-324": {"every_s": 5e-324},
    "grace_s 1e300": {"grace_s": 1e300},
    "parameters [1]": {"parameters": [1]},
    "a shape of 9 sizes": {"parameters": [["w", [1] * 9, "float32"]]},
    "rounds 'x'": {"rounds": "x"},
}


def test_a_creator_that_lies_in_its_description_creates_nothing(tmp_path):
    empty = _Served(tmp_path / "state", create=False)
    try:
        for lie, change in CREATOR_LIES.items():
            err = _refused(lambda change=change: empty.join("c", "s-c", spec={**SPEC, **change}))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (lie, err.code(), err.details())
            assert empty.fed.creator is None and empty.fed.pending_spec is None and not empty.fed.members.members, lie
        assert empty.join("c", "s-c")["status"] == "create"  # an honest description still creates it
    finally:
        empty.close()


# ------------------------------------------------------------------------------------ 7: errors you can read
def test_an_unexpected_exception_is_logged_and_answered_in_one_line_with_a_status(hub, monkeypatch):
    def broken(name, msg):
        raise KeyError("members")

    monkeypatch.setattr(hub.fed, "beat", broken)
    err = _refused(lambda: hub.call("Beat", session="session-a", facility="a"))
    assert err.code() == grpc.StatusCode.INTERNAL and err.details() == "the hub failed: KeyError: 'members'"
    assert "hub: refused a Beat: INTERNAL: the hub failed: KeyError: 'members'" in hub.logs

    def broken_stream(header, *cut):  # an exception while the response stream is read, after its first frame
        yield pack(header.to_json())
        raise OSError(28, "No space left on device")

    upload = hub.channel.stream_unary(f"/{SERVICE}/Upload")
    err = _refused(lambda: upload(iter([_nested(100_000)]), timeout=30))  # a malformed first frame of a stream
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "nested deeper than" in err.details()
    monkeypatch.setattr(hub.fed, "upload", lambda name, frames, *cut: [][1])
    header = pack({"session": "session-a", "kind": "round", "round": 0, "nbytes": 24, "facility": "a"})
    err = _refused(lambda: upload(iter([header]), timeout=30))
    assert err.code() == grpc.StatusCode.INTERNAL and "IndexError" in err.details()
    assert any(line.startswith("hub: refused a Upload: INTERNAL: the hub failed: IndexError") for line in hub.logs)

    monkeypatch.setattr(hub.fed, "_theta_frames", broken_stream)
    stream = hub.channel.unary_stream(f"/{SERVICE}/Fetch")(pack({"session": "session-a", "facility": "a"}), timeout=30)
    err = _refused(lambda: list(stream))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "No space left on device" in err.details()
    assert any(line.startswith("hub: refused a Fetch: RESOURCE_EXHAUSTED: ") for line in hub.logs)


# ------------------------------------------------------------------------------------ 7: the smaller findings
@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    from xffl_like.hub.identity import init_dir

    directory = tmp_path_factory.mktemp("certs") / "certs"
    init_dir(directory, ["a", "b"])
    return directory


def _copy(certs: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(certs, tmp_path / "certs"))  # modes kept (keys 0600)


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from xffl_like.hub.cli import main

    rc = main([*argv])
    return rc, capsys.readouterr().err


def test_a_damaged_certificate_stops_add_and_revoke_in_one_line(certs, tmp_path, capsys):
    d = _copy(certs, tmp_path)
    (d / "facilities" / "a.crt").write_text("-----BEGIN CERTIFICATE-----\nnot one\n-----END CERTIFICATE-----\n")
    for command in ("add", "revoke"):
        rc, err = _cli(capsys, command, str(d), "a")
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (command, err)
        assert f"{d / 'facilities' / 'a.crt'} is not a PEM certificate" in err and "restore it" in err


@pytest.mark.parametrize("listed", [["0a1b"], {"serials": "abc"}, {"serials": [1]}, {"serials": [], "names": []}])
def test_a_revocation_list_of_the_wrong_shape_is_refused_naming_the_file(certs, tmp_path, capsys, listed):
    from xffl_like.hub.identity import IdentityError, RevocationList, check_hub_identity

    d = _copy(certs, tmp_path)
    (d / "revoked.json").write_text(json.dumps(listed))
    line = f"{d / 'revoked.json'} is not a revocation list"
    with pytest.raises(IdentityError, match="is not a revocation list"):  # the hub: UNAVAILABLE, saying why
        RevocationList(d).is_revoked((d / "facilities" / "b.crt").read_bytes())
    with pytest.raises(IdentityError, match="is not a revocation list"):  # serve: refused at its start
        check_hub_identity(d)
    rc, err = _cli(capsys, "revoke", str(d), "b")
    assert rc == 2 and err.count("\n") == 1 and line in err and "restore it" in err, err


def test_a_private_key_readable_by_others_is_refused(certs, tmp_path, capsys):
    from xffl_like.hub.identity import IdentityError, check_facility_identity, check_hub_identity

    d = _copy(certs, tmp_path)
    ca, crt, key = d / "ca.crt", d / "facilities" / "a.crt", d / "facilities" / "a.key"
    assert check_facility_identity(ca, crt, key) == "a"
    key.chmod(0o644)
    with pytest.raises(IdentityError, match=r"readable by others \(mode 0644\).*chmod 600"):
        check_facility_identity(ca, crt, key)
    (d / "hub.key").chmod(0o640)
    with pytest.raises(IdentityError, match=r"hub.key is readable by others \(mode 0640\)"):
        check_hub_identity(d)
    (d / "ca.key").chmod(0o604)
    rc, err = _cli(capsys, "add", str(d), "c")
    assert rc == 2 and "ca.key is readable by others" in err and "chmod 600" in err, err


def test_plots_skip_the_rounds_an_elastic_facility_missed(tmp_path):
    from xffl_like.observe.plots import plot_aggregation

    rounds = [{"round": 0, "step": 2, "seconds": 0.01}, {"round": None, "step": 4, "seconds": 0.0,
              "status": "missed"}, {"round": 2, "step": 6, "seconds": 0.02}]  # fmt: skip
    assert plot_aggregation(rounds, tmp_path / "aggregation.png") is None
    assert (tmp_path / "aggregation.png").stat().st_size > 0
    assert "no aggregation round" in plot_aggregation(rounds[1:2], tmp_path / "none.png")


def _serve_limited(tmp_path: Path, soft: int, hard: int):
    """``hub serve --insecure`` started with at most ``soft`` (raisable to ``hard``) open files."""
    import resource
    import subprocess
    import sys

    from helpers.hub import ENV, REPO, free_port, wait_for

    port, log = free_port(), tmp_path / f"hub-{soft}-{hard}.log"
    cmd = [sys.executable, "-m", "xffl_like.hub", "serve", "--insecure", "--port", str(port), "--state",
           str(tmp_path / f"state-{soft}-{hard}")]  # fmt: skip
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))  # noqa: E731
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **ENV}, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=limit)  # fmt: skip
    wait_for(lambda: "serving on" in log.read_text() or proc.poll() is not None, 60, "the hub")
    assert proc.poll() is None, log.read_text()
    return proc, port, log


@pytest.mark.slow
@pytest.mark.parametrize("soft, hard", [(64, 64), (64, 1024)])
def test_idle_connections_past_the_descriptor_limit_do_not_stop_a_join(tmp_path, soft, hard):
    """More idle TCP connections than the hub may open files: the hub raises its soft limit to the hard one at
    its start, and closes connections that never finish their handshake (HANDSHAKE_S), so a join still gets in."""
    import socket

    proc, port, log = _serve_limited(tmp_path, soft, hard)
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            msg = {"spec": SPEC, "session": "s", "steps": 2, "probe": True, "facility": "x", "geometry": GEOMETRY}
            # 3 x HANDSHAKE_S; before, idle sockets held their descriptors 40 s and more (gRPC: up to 120 s)
            out = channel.unary_unary(f"/{SERVICE}/Join")(pack(msg), timeout=30, wait_for_ready=True)
        assert unpack(out)["status"] == "ok"
    finally:
        for s in idle:
            s.close()
        proc.terminate()
        proc.wait(timeout=30)
    assert f"{hard} open files" in log.read_text()  # the soft limit raised to the hard one
