"""The hub's identities, wire format and durable state, in one process (no training; the one ``cli`` test
runs the commands as new processes).

Identities are made with ``python -m xffl_like.hub init`` and read back with ``cryptography`` here; a
real mutual-TLS handshake through grpcio (the hub's own credentials and the facility's) checks what
the hub negotiates and sees. Bad files give one line each, naming the file and the fix.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import stat
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # gRPC core's info lines (the refused handshakes) stay quiet
import grpc  # after its verbosity is set
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from helpers import REPO

from xffl_like.hub import cli
from xffl_like.hub.identity import (
    IdentityError,
    RevocationList,
    add_facility,
    check_facility_identity,
    check_hub_identity,
    init_dir,
    peer_identity,
    revoke_facility,
)
from xffl_like.hub.protocol.messages import ArriveRequest, JoinRequest, MessageError, ResultRequest, UploadHeader
from xffl_like.hub.protocol.wire import CHUNK_BYTES, Frames, WireError, frames_of, pack, unpack
from xffl_like.hub.server import store

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "xffl_like.hub", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki") / "certs"
    hosts = ["--host", "localhost,127.0.0.1", "--host", "hub.example.org"]  # comma-separated and repeated
    assert cli.main(["init", str(d), "--facilities", "a,b", *hosts]) == 0
    return d


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_init_writes_a_ca_the_hub_and_one_identity_per_facility(pki):
    f = pki / "facilities"
    for key in (pki / "ca.key", pki / "hub.key", f / "a.key", f / "b.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    ca, hub, a = _cert(pki / "ca.crt"), _cert(pki / "hub.crt"), _cert(f / "a.crt")
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for leaf in (hub, a):
        leaf.verify_directly_issued_by(ca)
    sans = hub.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["localhost", "hub.example.org"]
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert ExtendedKeyUsageOID.SERVER_AUTH in hub.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert a.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "a"
    assert ExtendedKeyUsageOID.CLIENT_AUTH in a.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    key = serialization.load_pem_private_key((f / "a.key").read_bytes(), None)
    assert key.public_key().public_numbers() == a.public_key().public_numbers()
    assert check_facility_identity(pki / "ca.crt", f / "a.crt", f / "a.key") == "a"
    check_hub_identity(pki)


def test_init_checks_names_and_hosts_before_writing(tmp_path):
    for facilities, hosts, words in (
        (["a", "a"], None, "appears twice"),
        (["../a"], None, "facility name"),
        (["a"], ["bad host"], "neither a DNS name nor an IP address"),
    ):
        with pytest.raises(IdentityError, match=words):
            init_dir(tmp_path / "d", facilities, hosts)
        assert not (tmp_path / "d").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(IdentityError, match="is a file"):
        init_dir(tmp_path / "file", ["a"])
    init_dir(tmp_path / "v6", ["a"], ["[::1]", "*.example.org"])
    sans = _cert(tmp_path / "v6" / "hub.crt").extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)] == ["::1"]
    assert sans.get_values_for_type(x509.DNSName) == ["*.example.org"]


def test_add_revoke_and_reissue(tmp_path):
    d = tmp_path / "certs"
    init_dir(d, ["a"])
    listed = RevocationList(d)
    old = (d / "facilities" / "a.crt").read_bytes()
    assert not listed.is_revoked(old)
    add_facility(d, "c")
    with pytest.raises(IdentityError, match="already has a certificate"):
        add_facility(d, "c")
    revoke_facility(d, "a")
    assert listed.is_revoked(old)  # the same object sees the change: the hub needs no restart
    add_facility(d, "a")  # a new certificate for the name; the old serial stays revoked
    new = (d / "facilities" / "a.crt").read_bytes()
    assert listed.is_revoked(old) and not listed.is_revoked(new)
    assert stat.S_IMODE((d / "facilities" / "a.key").stat().st_mode) == 0o600
    revoke_facility(d, "a")  # the new one, too; both serials stay listed
    assert listed.is_revoked(new) and listed.is_revoked(old)


@pytest.mark.cli
def test_commands_answer_bad_input_in_one_line(pki, tmp_path):
    """Through ``python -m xffl_like.hub`` (a new process each): one line on stderr, exit 2, no traceback.
    (``serve``'s lines are checked in this process below: its new python would import torch; tests/test_hub.py
    runs it end to end.)"""
    cases = []
    for args, words in (
        (("init", str(pki), "--facilities", "c"), "is not empty"),  # never over an existing CA
        (("init", str(tmp_path / "new")), "--facilities"),  # argparse's mistakes are one line too
        (("revoke", str(pki), "zz"), "nothing to revoke"),
        (("add", str(pki), "bad name"), "facility name"),
        (("add", str(tmp_path / "none"), "x"), "no readable CA"),
    ):
        command = [sys.executable, "-m", "xffl_like.hub", *args]
        proc = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        cases.append((args, words, proc))
    for args, words, proc in cases:  # all at once: each is a new python
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and err.count("\n") == 1 and words in err, (args, err)
        assert err.startswith("error: ") and "Traceback" not in err
    init_dir(tmp_path / "certs", ["b"])
    ok = _cli("revoke", str(tmp_path / "certs"), "b")
    assert ok.returncode == 0 and ok.stdout.count("\n") == 1 and "facility b revoked" in ok.stdout, ok
    assert RevocationList(tmp_path / "certs").is_revoked((tmp_path / "certs" / "facilities" / "b.crt").read_bytes())


def _expired(pki: Path, out: Path) -> tuple[Path, Path]:
    """A certificate for 'a' signed by the CA that expired yesterday (and its key)."""
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), None)
    ca = _cert(pki / "ca.crt")
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "a")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=10))
        .not_valid_after(now - dt.timedelta(days=1))
        .sign(ca_key, hashes.SHA256())
    )
    out.mkdir(exist_ok=True)
    (out / "old.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (out / "old.key").write_bytes(pem)
    (out / "old.key").chmod(0o600)  # a private key open to others is refused first
    return out / "old.crt", out / "old.key"


def test_each_bad_identity_file_is_one_line(pki, tmp_path):
    f, ca = pki / "facilities", pki / "ca.crt"
    other = tmp_path / "other"
    init_dir(other, ["a"])
    old_crt, old_key = _expired(pki, tmp_path / "expired")
    (tmp_path / "garbage.crt").write_text("not a certificate")
    cases = [
        ((ca, tmp_path / "missing.crt", f / "a.key", None), "cannot read"),
        ((ca, tmp_path / "garbage.crt", f / "a.key", None), "is not a PEM certificate"),
        ((ca, f / "a.crt", f / "b.key", None), "does not match"),
        ((ca, other / "facilities" / "a.crt", other / "facilities" / "a.key", None), "was not issued by"),
        ((ca, old_crt, old_key, None), "expired on"),
        ((ca, f / "a.crt", f / "a.key", "b"), "is issued to 'a'"),
        ((ca, pki / "hub.crt", pki / "hub.key", None), "is not a facility's certificate"),
        ((ca, ca, pki / "ca.key", None), "is not a facility's certificate"),
    ]
    for args, words in cases:
        with pytest.raises(IdentityError) as info:
            check_facility_identity(*args)
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_the_identities_make_a_mutual_tls_13_grpc_handshake(pki, tmp_path):
    """The hub's gRPC credentials with the facility's: TLS 1.3, and the server sees the facility's CN and
    certificate; a certificate of another CA, or the hub's own (serverAuth only), is refused in the handshake."""
    other = tmp_path / "other"
    init_dir(other, ["a"])
    seen: list[dict] = []

    def echo(request: bytes, context) -> bytes:
        seen.append(context.auth_context())
        return request

    handler = grpc.method_handlers_generic_handler("t.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((handler,))
    ca, hub_cert, hub_key = check_hub_identity(pki)
    creds = grpc.ssl_server_credentials([(hub_key, hub_cert)], root_certificates=ca, require_client_auth=True)
    port = server.add_secure_port("localhost:0", creds)
    assert port > 0
    server.start()

    def dial(crt: Path, key: Path) -> bytes:
        mine = grpc.ssl_channel_credentials(ca, key.read_bytes(), crt.read_bytes())
        with grpc.secure_channel(f"localhost:{port}", mine) as channel:  # 'localhost': a SAN of hub.crt
            return channel.unary_unary("/t.Echo/Echo")(b"hello", timeout=10)

    try:
        f = pki / "facilities"
        assert dial(f / "a.crt", f / "a.key") == b"hello"
        auth = seen.pop()
        assert auth["x509_common_name"] == [b"a"] and auth["ssl_tls_version"] == [b"TLSv1.3"], auth
        name, serial, _ = peer_identity(auth["x509_pem_cert"][0])  # what the hub reads on every call
        assert (name, serial) == ("a", f"{_cert(f / 'a.crt').serial_number:x}")
        assert not RevocationList(pki).is_revoked(auth["x509_pem_cert"][0])
        for crt, key in (
            (other / "facilities" / "a.crt", other / "facilities" / "a.key"),  # another CA
            (pki / "hub.crt", pki / "hub.key"),  # the hub's certificate: not a client's
        ):
            with pytest.raises(grpc.RpcError) as info:
                dial(crt, key)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
        assert not seen  # refused in the handshake: the method never ran
    finally:
        server.stop(None)


def test_wire_checks_every_size_and_value():
    assert unpack(pack({"a": 1, "b": [1.5]})) == {"a": 1, "b": [1.5]}
    assert ResultRequest.decode(pack({"session": "s", "round": 1})) == ResultRequest("s", 1)
    for data, words in (
        (b"\xff", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"session": "s", "round": NaN}', "non-finite"),
        (b'{"session": "s", "round": true}', "round=True is not a int"),
        (b"x" * (2 << 20), "too large"),
    ):
        with pytest.raises(WireError, match=words):
            ResultRequest.decode(data)
    with pytest.raises(ValueError):
        pack({"x": float("inf")})
    flat = torch.arange(10, dtype=torch.float32)
    frames = list(frames_of(UploadHeader("s", "round", 0).to_json(), flat))
    assert Frames(iter(frames), 40, UploadHeader).into(torch.empty(10)).equal(flat)
    with pytest.raises(WireError, match="announced, expected 44"):
        Frames(iter(frames), 44, UploadHeader)
    header = UploadHeader("s", "round", 0, nbytes=40).encode()
    for chunks, words in (([b"\0" * 36], "36 bytes received"), ([b"\0" * 40, b"\0"], "more than the 40"),
                          ([b"\0" * (CHUNK_BYTES + 1)], "a frame of")):  # fmt: skip
        with pytest.raises(WireError, match=words):
            Frames(iter([header, *chunks]), 40, UploadHeader).into(torch.empty(10))


def test_messages_are_checked_in_one_place():
    """Every message is checked when decoded: its keys (none missing, none unknown), each value's type (an int
    is not a bool, a float is finite) and bounds; each refusal is one line naming the message and the key."""
    arrive = {"session": "s", "version": 2, "step": 4, "taken": 2, "tokens": 64}
    assert ArriveRequest.from_json(arrive) == ArriveRequest("s", 2, 4, 2, 64.0)
    geometry = {"batch_size": 2, "seq_len": 8, "dp": 1}
    spec = {"parameters": [["w", [6], "float32"]], "outer": {}, "compression": {"kind": "none"}, "grace_s": 60.0,
            "max_norm_ratio": 10.0}  # fmt: skip
    join = JoinRequest.from_json({"session": "s", "spec": spec, "geometry": geometry, "steps": 20})
    assert join.geometry.seq_len == 8 and join.every is None and join.to_json()["geometry"] == geometry
    for changed, words in (
        ({"tokens": "64"}, "ArriveRequest.tokens='64' is not a float"),
        ({"tokens": 1e400}, "ArriveRequest.tokens=inf is not a float"),
        ({"version": -1}, r"ArriveRequest.version=-1 is out of range"),
        ({"step": 4.0}, "ArriveRequest.step=4.0 is not a int"),
        ({"taken": False}, "ArriveRequest.taken=False is not a int"),
        ({"extra": 1}, "ArriveRequest: unknown key 'extra'"),
    ):
        with pytest.raises(MessageError, match=words) as info:
            ArriveRequest.from_json({**arrive, **changed})
        assert "\n" not in str(info.value)
    with pytest.raises(MessageError, match="ArriveRequest: key 'taken' missing"):
        ArriveRequest.from_json({k: v for k, v in arrive.items() if k != "taken"})
    with pytest.raises(MessageError, match=r"Geometry.dp=0 is out of range"):
        JoinRequest.from_json({"session": "s", "spec": spec, "geometry": {**geometry, "dp": 0}, "steps": 20})
    with pytest.raises(ValueError, match="lists no parameters"):  # the description too (spec.check_spec)
        JoinRequest.from_json({"session": "s", "spec": {}, "geometry": geometry, "steps": 20})
    with pytest.raises(MessageError, match="UploadHeader.kind='delete' is not a"):
        UploadHeader.from_json({"session": "s", "kind": "delete"})


def test_state_is_atomic_keeps_two_and_refuses_damage(tmp_path):
    theta = torch.randn(1000)
    for v in range(1, 4):
        spec = {"parameters": [["w", [1000], "float32"]]}  # the sizes a loaded state must have
        store.save(tmp_path, store.Snapshot(v, spec, theta + v, {"momentum_buffer": theta * v}, v, v, False, {}))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"state-{v:010d}.safetensors" for v in (2, 3)]
    snap = store.load_latest(tmp_path)
    assert (
        snap.version == 3
        and torch.equal(snap.theta, theta + 3)
        and torch.equal(snap.buffers["momentum_buffer"], theta * 3)
    )
    newest = tmp_path / "state-0000000003.safetensors"
    data = bytearray(newest.read_bytes())
    data[-7] ^= 0x40  # one bit in θ's last values
    newest.write_bytes(bytes(data))
    with pytest.raises(store.StateError, match="checksum"):
        store.load_latest(tmp_path)
    newest.write_bytes(bytes(data[:100]))
    with pytest.raises(store.StateError, match="damaged or unreadable"):
        store.load_latest(tmp_path)


def test_serve_refuses_damaged_state_missing_certs_and_a_busy_port_in_one_line(tmp_path, capsys):
    state = tmp_path / "state"
    state.mkdir()
    (state / "state-0000000001.safetensors").write_bytes(b"garbage")
    assert cli.main(["serve", "--port", "1", "--certs", str(tmp_path / "none"), "--state", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "ca.crt" in err, err
    assert cli.main(["serve", "--port", "1", "--insecure", "--state", str(state)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "--fresh" in err, err
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    start = time.time()
    try:
        code = cli.main(["serve", "--port", str(busy.getsockname()[1]), "--insecure", "--state", str(tmp_path / "new")])
    finally:
        busy.close()
    err = capsys.readouterr().err
    assert code == 2 and "choose a free --port" in err and time.time() - start < 30, err
