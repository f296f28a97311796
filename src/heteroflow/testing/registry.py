"""A private image registry for the Docker tier's pull tests (H7): Debian's
``docker-registry`` (the CNCF distribution registry, v2) as a plain process, with
htpasswd auth (bcrypt) and TLS under a CA made for the run, which the private dockerd
is told to trust.

``start_registry`` listens on the private dockerd's bridge address (its host side), not
on loopback: a Docker Engine takes any 127.0.0.0/8 registry as insecure and skips the
certificate check, so a loopback registry would prove nothing about trust. The CA goes to
``/etc/docker/certs.d/<host:port>/ca.crt`` — the one place a root dockerd reads registry
CAs from (at every pull, no restart: scripts/test-dockerd's flags stay as they are); the
directory is named by this run's port and removed by ``stop``.

Installed by the scripts (``ensure_registry`` in scripts/_venv.sh: apt when root);
``RegistryUnavailable`` says why it cannot run here, and the tests skip with it (or
fail under ``HETEROFLOW_REQUIRE_DOCKER=1``: the registry belongs to the Docker tier).
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

CERTS_D = Path("/etc/docker/certs.d")
BINARY = "docker-registry"


class RegistryUnavailable(Exception):
    """The test registry cannot run here (the reason says why)."""


@dataclass
class PrivateRegistry:
    host: str  # "address:port", as image references and credentials name it
    username: str
    password: str = field(repr=False)
    work: Path
    proc: subprocess.Popen[bytes] | None = None
    ca_dir: Path | None = None

    def image(self, path: str) -> str:
        return f"{self.host}/{path}"

    def log(self) -> str:
        f = self.work / "registry.log"
        return f.read_text(errors="replace") if f.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.ca_dir is not None:
            shutil.rmtree(self.ca_dir, ignore_errors=True)


def _write_tls(work: Path, address: str) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for ``address`` signed by it (cryptography)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "heteroflow test registry CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, address)]))
        .issuer_name(ca_name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(address))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_file, cert_file, key_file = work / "ca.crt", work / "registry.crt", work / "registry.key"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_file, cert_file, key_file


def _htpasswd(username: str, password: str) -> str:
    try:
        import bcrypt
    except ImportError as exc:  # a test dependency (pyproject's test extra)
        raise RegistryUnavailable("bcrypt is not installed (pip install bcrypt)") from exc
    return f"{username}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=5)).decode()}\n"


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        port: int = s.getsockname()[1]
        return port


def start_registry(
    work: Path, address: str, username: str, password: str, certs_d: Path = CERTS_D
) -> PrivateRegistry:
    """A registry on ``address`` (a free port), trusted by a root dockerd; see the module."""
    binary = shutil.which(BINARY)
    if binary is None:
        raise RegistryUnavailable(
            "docker-registry is not installed (Debian: apt-get install docker-registry; "
            "scripts/test does it when root)"
        )
    if not certs_d.parent.exists() and not certs_d.exists():
        certs_d.parent.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    ca_file, cert_file, key_file = _write_tls(work, address)
    (work / "htpasswd").write_text(_htpasswd(username, password))
    port = _free_port(address)
    host = f"{address}:{port}"
    (work / "config.yml").write_text(
        "version: 0.1\n"
        "log:\n  level: info\n"
        f"storage:\n  filesystem:\n    rootdirectory: {work / 'data'}\n"
        "  delete:\n    enabled: true\n"
        f"http:\n  addr: {host}\n  tls:\n    certificate: {cert_file}\n    key: {key_file}\n"
        f"auth:\n  htpasswd:\n    realm: heteroflow-test\n    path: {work / 'htpasswd'}\n"
    )
    ca_dir = certs_d / host
    try:
        ca_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(ca_file, ca_dir / "ca.crt")
    except OSError as exc:
        raise RegistryUnavailable(f"cannot write {ca_dir} (needs root): {exc}") from exc
    log = (work / "registry.log").open("ab")
    proc = subprocess.Popen(
        [binary, "serve", str(work / "config.yml")], stdout=log, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    reg = PrivateRegistry(host, username, password, work, proc, ca_dir)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            reg.stop()
            raise RegistryUnavailable(f"docker-registry exited: {reg.log()[-800:]}")
        try:
            with socket.create_connection((address, port), timeout=0.5):
                return reg
        except OSError:
            time.sleep(0.1)
    reg.stop()
    raise RegistryUnavailable(f"docker-registry did not listen on {host}: {reg.log()[-800:]}")
