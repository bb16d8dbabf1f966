"""The hub's identities, wire format and durable state, in one process (no training).

Identities are made with ``python -m xffl_like.hub init`` and read back with ``cryptography`` here; a
real mutual-TLS handshake with Python's own ``ssl`` module checks what the hub negotiates. Bad files
give one line each, naming the file and the fix.
"""

from __future__ import annotations

import datetime as dt
import os
import socket
import ssl
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from helpers import REPO

from xffl_like.hub import store
from xffl_like.hub.identity import (
    IdentityError,
    RevocationList,
    add_facility,
    check_facility_identity,
    check_hub_identity,
    init_dir,
    revoke_facility,
)
from xffl_like.hub.wire import CHUNK_BYTES, Frames, WireError, frames_of, pack, unpack

ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "xffl_like.hub", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=60)  # fmt: skip


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("pki") / "certs"
    out = _cli("init", str(d), "--facilities", "a,b", "--host", "localhost,127.0.0.1,hub.example.org")
    assert out.returncode == 0 and out.stderr == "", out.stderr
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
    again = _cli("init", str(pki), "--facilities", "c")  # never over an existing CA
    assert again.returncode == 2 and again.stderr.count("\n") == 1 and "is not empty" in again.stderr


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
    for args, words in (
        (("revoke", str(d), "zz"), "nothing to revoke"),
        (("add", str(d), "bad name"), "facility name"),
        (("add", str(tmp_path / "none"), "x"), "no readable CA"),
    ):
        out = _cli(*args)
        assert out.returncode == 2 and out.stderr.count("\n") == 1 and words in out.stderr, out.stderr
        assert "Traceback" not in out.stderr


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
    ]
    for args, words in cases:
        with pytest.raises(IdentityError) as info:
            check_facility_identity(*args)
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def _serve_tls(pki: Path, ready: threading.Event, result: dict, port_box: list) -> None:
    """A TLS server with the hub's identity that requires a client certificate (as the hub's gRPC server does)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(pki / "hub.crt", pki / "hub.key")
    ctx.load_verify_locations(pki / "ca.crt")
    ctx.verify_mode = ssl.CERT_REQUIRED
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        port_box.append(s.getsockname()[1])
        ready.set()
        s.settimeout(20)
        for _ in range(2):
            conn, _ = s.accept()
            try:
                with ctx.wrap_socket(conn, server_side=True) as tls:
                    result.setdefault("peers", []).append(tls.getpeercert()["subject"])
            except ssl.SSLError as exc:
                result.setdefault("refused", []).append(str(exc))


def test_the_identities_make_a_mutual_tls_13_handshake(pki, tmp_path):
    other = tmp_path / "other"
    init_dir(other, ["a"])
    ready, result, port = threading.Event(), {}, []
    server = threading.Thread(target=_serve_tls, args=(pki, ready, result, port), daemon=True)
    server.start()
    ready.wait(10)

    def dial(certs: Path) -> str:
        ctx = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        ctx.load_cert_chain(certs / "facilities" / "a.crt", certs / "facilities" / "a.key")
        with socket.create_connection(("127.0.0.1", port[0]), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
                version = tls.version()
                tls.recv(1)  # the server's verdict on our certificate arrives after the handshake in TLS 1.3
                return version

    assert dial(pki) == "TLSv1.3"
    with pytest.raises((ssl.SSLError, ConnectionError)):
        dial(other)  # a certificate from another CA
    server.join(10)
    assert result["peers"][0] == ((("commonName", "a"),),) and len(result["refused"]) == 1, result


def test_wire_checks_every_size_and_value():
    assert unpack(pack({"a": 1, "b": [1.5]}), {"a": int}) == {"a": 1, "b": [1.5]}
    for data, words in (
        (b"\xff", "not JSON"),
        (b"[1]", "not a JSON object"),
        (b'{"a": NaN}', "non-finite"),
        (b'{"a": true}', "a=True is not a int"),
        (b"x" * (2 << 20), "too large"),
    ):
        with pytest.raises(WireError, match=words):
            unpack(data, {"a": int})
    with pytest.raises(ValueError):
        pack({"x": float("inf")})
    flat = torch.arange(10, dtype=torch.float32)
    frames = list(frames_of({"kind": "round"}, flat))
    assert Frames(iter(frames), 40).into(torch.empty(10)).equal(flat)
    with pytest.raises(WireError, match="announced, expected 44"):
        Frames(iter(frames), 44)
    header = pack({"nbytes": 40})
    for chunks, words in (([b"\0" * 36], "36 bytes received"), ([b"\0" * 40, b"\0"], "more than the 40"),
                          ([b"\0" * (CHUNK_BYTES + 1)], "a frame of")):  # fmt: skip
        with pytest.raises(WireError, match=words):
            Frames(iter([header, *chunks]), 40).into(torch.empty(10))


def test_state_is_atomic_keeps_two_and_refuses_damage(tmp_path):
    theta = torch.randn(1000)
    for v in range(1, 4):
        store.save(tmp_path, store.Snapshot(v, {"s": 1}, theta + v, {"momentum_buffer": theta * v}, v, v, False, {}))
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


def test_serve_refuses_damaged_state_and_missing_certs_in_one_line(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "state-0000000001.safetensors").write_bytes(b"garbage")
    out = _cli("serve", "--port", "1", "--insecure", "--state", str(state))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "--fresh" in out.stderr, out.stderr
    out = _cli("serve", "--port", "1", "--certs", str(tmp_path / "none"), "--state", str(state))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "ca.crt" in out.stderr, out.stderr
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    start = time.time()
    out = _cli("serve", "--port", str(busy.getsockname()[1]), "--insecure", "--state", str(tmp_path / "new"))
    busy.close()
    assert out.returncode == 2 and "choose a free --port" in out.stderr and time.time() - start < 30, out
