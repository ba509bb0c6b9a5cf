"""The simulated development root CA: created on first use, never pinned by a production policy.

It lives in ``$VEIL_SIM_ROOT_DIR`` (default ``~/.cache/veil/sim-root``), a
folder created with 0700 permissions holding one file, ``root.pem``: the CA's
private key and certificate (0600). Every certificate it issues says
SIMULATED in its subject.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from attestation.certs import fingerprint
from attestation.errors import BackendError

ROOT_DIR_ENV = "VEIL_SIM_ROOT_DIR"
ROOT_FILE = "root.pem"
ROOT_COMMON_NAME = "Veil SIMULATED Development Root CA"


@dataclass(frozen=True)
class SimRoot:
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.certificate)


def sim_root_dir() -> Path:
    """Where the simulated root lives on this machine."""
    configured = os.environ.get(ROOT_DIR_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "veil" / "sim-root"


def local_sim_root_certificate(directory: Path | None = None) -> x509.Certificate | None:
    """The simulated root's certificate if one exists here; never creates one."""
    path = (directory or sim_root_dir()) / ROOT_FILE
    if not path.is_file():
        return None
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except ValueError:
        return None


def load_or_create_sim_root(directory: Path | None = None) -> SimRoot:
    """The simulated root, created on first use."""
    folder = directory or sim_root_dir()
    path = folder / ROOT_FILE
    if path.is_file():
        return _read(path)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    root = _create()
    _publish(root, path)
    return _read(path)  # another process may have won the race: use what is on disk


def issue(
    issuer: SimRoot,
    common_name: str,
    public_key: ec.EllipticCurvePublicKey,
    *,
    is_ca: bool,
    days: int = 365,
) -> x509.Certificate:
    """A certificate for `public_key` signed by `issuer` (used for the simulated device chains)."""
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(issuer.certificate.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
    )
    return builder.sign(issuer.private_key, hashes.SHA384())


def _create() -> SimRoot:
    key = ec.generate_private_key(ec.SECP384R1())
    name = _name(ROOT_COMMON_NAME)
    now = dt.datetime.now(dt.timezone.utc)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA384())
    )
    return SimRoot(certificate, key)


def _name(common_name: str) -> x509.Name:
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Veil development (SIMULATED, no hardware protection)"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
    ])


def _publish(root: SimRoot, path: Path) -> None:
    key_pem = root.private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    temporary = path.with_name(f".{ROOT_FILE}.{os.getpid()}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(key_pem + root.certificate.public_bytes(serialization.Encoding.PEM))
    try:
        os.link(temporary, path)  # fails if another process published first; theirs is kept
    except FileExistsError:
        pass
    finally:
        temporary.unlink()


def _read(path: Path) -> SimRoot:
    data = path.read_bytes()
    try:
        key = serialization.load_pem_private_key(data, password=None)
        certificate = x509.load_pem_x509_certificate(data)
    except ValueError:
        raise BackendError(f"the simulated root in {path.parent} is corrupt; delete the folder to recreate it") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise BackendError(f"the simulated root in {path.parent} is not an ECDSA key; delete the folder")
    return SimRoot(certificate, key)
