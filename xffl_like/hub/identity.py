"""Identities of a hub's federation: a CA, the hub's certificate, one certificate per facility.

``python -m xffl_like.hub init DIR --facilities a,b [--host names]`` writes::

    DIR/ca.crt  DIR/ca.key                      the federation's CA (keep ca.key on the hub's host)
    DIR/hub.crt DIR/hub.key                     the hub's identity; --host names and addresses as SANs
    DIR/facilities/<name>.crt, <name>.key       one per facility; its common name is the facility's name

Keys are EC P-256, PKCS#8 PEM, created mode 0600 (never readable by others, not even briefly).
Revocation is by certificate serial (``DIR/revoked.json``, written atomically): the hub re-reads it when
it changes, so a revoked facility is refused from its next call, and ``add`` can issue the same name a
new certificate.

What each facility may claim is the operator's too (``DIR/grants.json``, written by ``init``/``add`` with
``--batch-size``, ``--seq-len``, ``--dp``, ``--steps``; re-read by the hub when it changes): a facility's batch
geometry (what bounds the tokens it may claim per step) and its steps, each at most its grant. A facility
without a grant is bounded by the federation alone. Everything is made with the ``cryptography`` package;
nothing shells out to openssl.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import os
import re
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .errors import GRANT_KEYS, IdentityError

__all__ = [
    "GRANT_KEYS",
    "Grants",
    "IdentityError",
    "RevocationList",
    "add_facility",
    "check_facility_identity",
    "check_hub_identity",
    "init_dir",
    "is_issued",
    "peer_identity",
    "revoke_facility",
    "write_grant",
]

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_HEX = re.compile(r"^[0-9a-f]{1,64}$")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
HOST = re.compile(rf"^(?:\*\.)?{_LABEL}(?:\.{_LABEL})*$")  # a DNS name (a leading '*.' allowed) for the hub's SANs
DAYS = 825


# ---------------------------------------------------------------------------- writing
def _write_key(path: Path, key) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _builder(subject: str, issuer: x509.Name, public_key, days: int) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
    )


def _sans(hosts: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for host in hosts:
        bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # [::1]
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(bare)))
        except ValueError:
            if not HOST.match(host) or len(host) > 253:
                raise IdentityError(
                    f"--host {host!r} is neither a DNS name nor an IP address: give the names and addresses "
                    f"facilities dial, comma-separated, e.g. --host hub.example.org,192.0.2.10"
                ) from None
            out.append(x509.DNSName(host))
    return out


def _leaf(ca_key, ca_cert, cn: str, sans: list[x509.GeneralName], usage, days: int):
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(cn, ca_cert.subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.KeyUsage(True, False, True, False, False, False, False, False, False), critical=True
        )  # digital signature, key encipherment
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.match(name):
        raise IdentityError(f"facility name {name!r}: use letters, digits, '.', '_' or '-' (at most 63), e.g. leonardo")
    return name


def init_dir(path: str | Path, facilities: list[str], hosts: list[str] | None = None, days: int = DAYS) -> list[Path]:
    """A new federation's identities in ``path`` (absent or empty); the files written."""
    path = Path(path)
    names = [_check_name(n) for n in facilities]
    if len(set(names)) != len(names):
        raise IdentityError(f"--facilities {','.join(names)}: a name appears twice")
    if days < 1:
        raise IdentityError(f"days={days}: certificates must be valid for at least one day")
    if path.exists() and not path.is_dir():
        raise IdentityError(f"{path} is a file: init writes a new CA into an empty or new directory")
    if path.exists() and any(path.iterdir()):
        raise IdentityError(f"{path} is not empty: init writes a new CA into an empty or new directory (or use add)")
    sans = _sans(hosts or ["localhost", "127.0.0.1"])  # checked before anything is written
    (path / "facilities").mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        _builder("xffl_like federation CA", _name("xffl_like federation CA"), ca_key.public_key(), days + 1)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(path / "ca.key", ca_key)
    _write_cert(path / "ca.crt", ca_cert)
    hub_key, hub_cert = _leaf(ca_key, ca_cert, "xffl_like hub", sans, ExtendedKeyUsageOID.SERVER_AUTH, days)
    _write_key(path / "hub.key", hub_key)
    _write_cert(path / "hub.crt", hub_cert)
    written = [path / "ca.crt", path / "ca.key", path / "hub.crt", path / "hub.key"]
    for name in names:
        written += _issue(path, ca_key, ca_cert, name, days)
    return written


def _ca(path: Path):
    if (path / "ca.key").exists() and (path / "ca.key").stat().st_mode & 0o077:
        raise IdentityError(f"{path / 'ca.key'} is readable by others: the CA's key must be the owner's alone: "
                            f"chmod 600 {path / 'ca.key'}")  # fmt: skip
    try:
        ca_cert = x509.load_pem_x509_certificate((path / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((path / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise IdentityError(f"{path}: no readable CA (ca.crt, ca.key: {exc}); make one with init") from None
    return ca_key, ca_cert


def _issue(path: Path, ca_key, ca_cert, name: str, days: int) -> list[Path]:
    key, cert = _leaf(ca_key, ca_cert, name, [x509.DNSName(name)], ExtendedKeyUsageOID.CLIENT_AUTH, days)
    key_path, cert_path = path / "facilities" / f"{name}.key", path / "facilities" / f"{name}.crt"
    key_path.unlink(missing_ok=True)  # a revoked facility's old key (its serial stays revoked)
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return [cert_path, key_path]


def add_facility(path: str | Path, name: str, days: int = DAYS) -> list[Path]:
    """One more facility's identity (or a new one for a revoked name); the files written."""
    path = Path(path)
    _check_name(name)
    ca_key, ca_cert = _ca(path)
    cert_path = path / "facilities" / f"{name}.crt"
    if cert_path.exists():
        old = _existing_cert(cert_path, name)
        if not RevocationList(path).is_revoked(old):
            raise IdentityError(
                f"facility {name} already has a certificate ({cert_path}): revoke it first "
                f"(python -m xffl_like.hub revoke {path} {name}) or choose another name"
            )
    return _issue(path, ca_key, ca_cert, name, days)


def is_issued(path: str | Path, name: str) -> bool:
    """Whether facility ``name`` has a certificate in ``path`` that is not revoked."""
    path = Path(path)
    cert_path = path / "facilities" / f"{_check_name(name)}.crt"
    if not cert_path.exists():
        return False
    return not RevocationList(path).is_revoked(_existing_cert(cert_path, name))


def _existing_cert(cert_path: Path, name: str) -> x509.Certificate:
    """A facility's certificate as add and revoke read it (:class:`IdentityError`: damaged)."""
    try:
        return x509.load_pem_x509_certificate(cert_path.read_bytes())
    except ValueError:
        raise IdentityError(
            f"{cert_path} is not a PEM certificate (damaged?): restore it from a copy (its serial is what revoke "
            f"lists; facility {name} still holds it), then run the command again"
        ) from None


def _serial(cert: x509.Certificate) -> str:
    return f"{cert.serial_number:x}"


def revoke_facility(path: str | Path, name: str) -> str:
    """Revoke facility ``name``'s current certificate; its serial."""
    path = Path(path)
    cert_path = path / "facilities" / f"{_check_name(name)}.crt"
    if not cert_path.exists():
        raise IdentityError(f"no facility {name} in {path} (no {cert_path}): nothing to revoke")
    serial = _serial(_existing_cert(cert_path, name))
    listed = RevocationList(path).load()
    listed["serials"] = sorted(set(listed["serials"]) | {serial})
    listed["names"].setdefault(name, [])
    if serial not in listed["names"][name]:
        listed["names"][name].append(serial)
    target = path / "revoked.json"
    tmp = path / ".revoked.json.tmp"
    with open(tmp, "w") as fh:
        json.dump(listed, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, target)
    try:  # the rename itself survives a crash of the host
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return serial


class RevocationList:
    """The revoked serials of ``DIR/revoked.json``, re-read whenever the file changes (cheap per call)."""

    def __init__(self, path: str | Path):
        self.file = Path(path) / "revoked.json"
        self._seen: tuple | None = None
        self._serials: frozenset[str] = frozenset()

    def load(self) -> dict:
        try:
            data = json.loads(self.file.read_text())
        except FileNotFoundError:
            return {"serials": [], "names": {}}
        except (OSError, ValueError) as exc:
            raise IdentityError(f"{self.file} is unreadable ({exc}): restore it or revoke again") from None
        serials, names = (data.get("serials", []), data.get("names", {})) if isinstance(data, dict) else (None, None)
        if not (
            isinstance(serials, list)
            and all(isinstance(s, str) and _HEX.match(s) for s in serials)
            and isinstance(names, dict)
            and all(isinstance(v, list) and all(isinstance(s, str) for s in v) for v in names.values())
        ):
            raise IdentityError(
                f'{self.file} is not a revocation list ({{"serials": [hex serials], "names": {{name: [serials]}}}}, as '
                f"revoke writes it): restore it from a copy, or rewrite it in that form"
            )
        return {"serials": list(serials), "names": dict(names)}

    def _refresh(self) -> None:
        try:
            st = self.file.stat()
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            seen = None
        if seen != self._seen:
            self._serials = frozenset(self.load()["serials"]) if seen else frozenset()
            self._seen = seen

    def is_revoked(self, cert) -> bool:
        if isinstance(cert, (bytes, str)):
            cert = x509.load_pem_x509_certificate(cert.encode() if isinstance(cert, str) else cert)
        self._refresh()
        return _serial(cert) in self._serials


def peer_identity(pem: bytes) -> tuple[str, str, dt.datetime]:
    """(common name, serial in hex, not valid after) of a PEM certificate."""
    cert = x509.load_pem_x509_certificate(pem)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return (str(names[0].value) if names else ""), _serial(cert), cert.not_valid_after_utc


# ---------------------------------------------------------------------------- checking
def _read(path, what: str, key: str) -> bytes:
    if path is None:
        raise IdentityError(f"{key} is not set: give the {what}")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise IdentityError(
            f"{key}={path}: cannot read the {what} ({exc.strerror}): fix the path or its permissions"
        ) from None


def _load_cert(data: bytes, path, key: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError:
        raise IdentityError(f"{key}={path} is not a PEM certificate: give the .crt that hub init/add wrote") from None


def _private(path, what: str, key: str) -> bytes:
    """A private key's bytes, refused when its file is open to the group or others (as ssh refuses)."""
    data = _read(path, what, key)
    mode = Path(path).stat().st_mode & 0o777
    if mode & 0o077:
        raise IdentityError(
            f"{key}={path} is readable by others (mode {mode:04o}): a private key must be the owner's alone: "
            f"chmod 600 {path}"
        )
    return data


def _load_key(data: bytes, path, key: str):
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise IdentityError(
            f"{key}={path} is not an unencrypted PEM private key: give the .key that hub init/add wrote"
        ) from None


def _same_key(cert: x509.Certificate, private) -> bool:
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == private.public_key().public_bytes(*fmt)


def _signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    try:
        cert.verify_directly_issued_by(ca)
        return True
    except (ValueError, TypeError, InvalidSignature):
        return False


def _is_client_cert(cert: x509.Certificate) -> bool:
    try:
        if cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca:
            return False
    except x509.ExtensionNotFound:
        pass
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return True  # no EKU: any purpose (TLS accepts it as a client's)
    return ExtendedKeyUsageOID.CLIENT_AUTH in usages


def _valid_now(cert: x509.Certificate, path, key: str) -> None:
    now = dt.datetime.now(dt.timezone.utc)
    if now > cert.not_valid_after_utc:
        raise IdentityError(
            f"{key}={path} expired on {cert.not_valid_after_utc:%Y-%m-%d}: ask the hub's operator for a new one "
            f"(python -m xffl_like.hub revoke DIR NAME, then add DIR NAME)"
        )
    if now < cert.not_valid_before_utc:
        raise IdentityError(
            f"{key}={path} is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC: check this host's clock"
        )


def check_facility_identity(ca, cert, key, facility: str | None = None) -> str:
    """A facility's files, checked before it dials: readable, the key matching the certificate, the certificate
    signed by the CA, a client's (clientAuth) and valid now, its common name ``facility`` when given. Returns the
    name. Raises :class:`IdentityError` (one line: the file, the problem, the fix): a hub refuses a bad certificate
    with nothing but a closed socket on the facility's side, so this is where the facility learns why."""
    k = "federation.elastic"
    ca_cert = _load_cert(_read(ca, "hub's CA certificate (DIR/ca.crt)", f"{k}.ca"), ca, f"{k}.ca")
    mine = _load_cert(_read(cert, "facility's certificate", f"{k}.cert"), cert, f"{k}.cert")
    private = _load_key(_private(key, "facility's private key", f"{k}.key"), key, f"{k}.key")
    if not _same_key(mine, private):
        raise IdentityError(f"{k}.key={key} does not match {k}.cert={cert}: give the .key written beside that .crt")
    if not _signed_by(mine, ca_cert):
        raise IdentityError(
            f"{k}.cert={cert} was not issued by {k}.ca={ca}: use the certificate and CA of the same "
            f"`python -m xffl_like.hub init`"
        )
    if not _is_client_cert(mine):
        raise IdentityError(
            f"{k}.cert={cert} is not a facility's certificate (a CA's or the hub's: no clientAuth usage): "
            f"give DIR/facilities/<name>.crt from hub init/add"
        )
    _valid_now(mine, cert, f"{k}.cert")
    name = peer_identity(mine.public_bytes(serialization.Encoding.PEM))[0]
    if facility is not None and facility != name:
        raise IdentityError(
            f"federation.elastic.facility={facility} but {k}.cert={cert} is issued to {name!r}: set "
            f"federation.elastic.facility={name} (or leave it unset), or use {facility}'s certificate"
        )
    return name


def check_hub_identity(directory: str | Path) -> tuple[bytes, bytes, bytes]:
    """``serve --certs DIR``: the CA, the hub's certificate and key (PEM), checked; raises :class:`IdentityError`."""
    d = Path(directory)
    ca = _read(d / "ca.crt", "CA certificate (from hub init)", "--certs")
    cert = _read(d / "hub.crt", "hub's certificate (from hub init)", "--certs")
    key = _private(d / "hub.key", "hub's key (from hub init)", "--certs")
    ca_cert, hub_cert = _load_cert(ca, d / "ca.crt", "--certs"), _load_cert(cert, d / "hub.crt", "--certs")
    if not _same_key(hub_cert, _load_key(key, d / "hub.key", "--certs")):
        raise IdentityError(f"--certs {d}: hub.key does not match hub.crt: run init again into a new directory")
    if not _signed_by(hub_cert, ca_cert):
        raise IdentityError(f"--certs {d}: hub.crt was not issued by ca.crt: run init again into a new directory")
    _valid_now(hub_cert, d / "hub.crt", "--certs")
    RevocationList(d).load()  # a damaged revocation list stops the hub at its start, not at every call
    return ca, cert, key


# ---------------------------------------------------------------------------- grants
def _check_grant(name: str, grant, where) -> dict[str, int]:
    if not isinstance(grant, dict) or set(grant) - set(GRANT_KEYS):
        raise IdentityError(f"{where}: facility {name}'s grant must be an object of {', '.join(GRANT_KEYS)}")
    for key, value in grant.items():
        if type(value) is not int or not 1 <= value <= GRANT_KEYS[key]:
            raise IdentityError(f"{where}: facility {name}'s {key}={value!r} is not an integer in 1..{GRANT_KEYS[key]}")
    return dict(grant)


def read_grants(path: str | Path) -> dict[str, dict[str, int]]:
    """The grants of ``DIR/grants.json`` by facility, checked (none when there is no file)."""
    file = Path(path) / "grants.json"
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise IdentityError(f"{file} is unreadable ({exc}): restore it, or write it again with add") from None
    facilities = data.get("facilities") if isinstance(data, dict) else None
    if not isinstance(facilities, dict):
        raise IdentityError(f'{file}: expected {{"facilities": {{NAME: {{...}}}}}}: write it again with add')
    return {_check_name(n): _check_grant(n, g, file) for n, g in facilities.items()}


def write_grant(path: str | Path, name: str, grant: dict[str, int]) -> None:
    """Facility ``name``'s grant in ``DIR/grants.json`` (replacing its old one), written atomically."""
    path = Path(path)
    grants = read_grants(path)
    grants.pop(_check_name(name), None)
    if grant:
        grants[name] = _check_grant(name, grant, "the grant")
    tmp = path / ".grants.json.tmp"
    with open(tmp, "w") as fh:
        json.dump({"facilities": grants}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / "grants.json")


class Grants:
    """The grants of ``DIR/grants.json``, re-read whenever the file changes; ``grants(name)``: one's (or None)."""

    def __init__(self, path: str | Path):
        self.dir = Path(path)
        self._seen: tuple | None = None
        self._grants: dict[str, dict[str, int]] = {}

    def __call__(self, name: str) -> dict[str, int] | None:
        try:
            st = (self.dir / "grants.json").stat()
            seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            seen = None
        if seen != self._seen:
            self._grants = read_grants(self.dir) if seen else {}
            self._seen = seen
        return self._grants.get(name)
