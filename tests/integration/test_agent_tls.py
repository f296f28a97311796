"""TLS between agents and the server (issue 18): `heteroflow server --tls-cert/--tls-key`
serves https, and an agent verifies it against HETEROFLOW_AGENT_CA_FILE — or says, in
one line, what to set when the certificate does not verify."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from heteroflow.agent.client import ServerClient, ServerTlsError, tls_context
from heteroflow.cli import main
from heteroflow.core.clock import FakeClock
from heteroflow.schemas.nodes import Heartbeat, InventoryWire
from heteroflow.server import ServerApp
from heteroflow.serving import bind
from heteroflow.settings import AgentSettings, ServerSettings

NODE_TOKEN = "node-token-for-tls"
EC = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path, name: str) -> Path:
    """A private CA (as docs/operations.md makes one): ``d/NAME.pem``, ``d/NAME.key``."""
    _openssl(
        "req", "-x509", *EC, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d,
    )
    return d / f"{name}.pem"


def make_server_cert(d: Path, ca: str, san: str) -> tuple[Path, Path]:
    """The server's certificate for ``san``, signed by the CA ``ca``."""
    _openssl("req", *EC, "-subj", "/CN=server", "-keyout", "server.key", "-out", "server.csr",
             cwd=d)
    (d / "server.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage=serverAuth\n")
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-days", "2", "-extfile", "server.ext", "-out", "server.pem", cwd=d,
    )
    return d / "server.pem", d / "server.key"


@dataclass
class Pki:
    ca: Path
    other_ca: Path
    cert: Path
    key: Path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make the test's certificates")
    d = tmp_path_factory.mktemp("pki")
    ca = make_ca(d, "ca")
    other = make_ca(d, "other-ca")
    cert, key = make_server_cert(d, "ca", "IP:127.0.0.1")
    return Pki(ca, other, cert, key)


@pytest.fixture
async def https_url(pki: Pki, tmp_path: Path) -> AsyncIterator[str]:
    """A server on https (its certificate names 127.0.0.1), serving in this loop."""
    settings = ServerSettings(
        data_dir=tmp_path / "data", node_token=NODE_TOKEN, admin_password="admin-pass-1",
        tls_cert_file=pki.cert, tls_key_file=pki.key,
    )
    app = ServerApp(settings, clock=FakeClock())
    sock = bind("127.0.0.1", 0)
    stop = asyncio.Event()
    serving = asyncio.create_task(app.serve(stop, sock))
    try:
        yield f"https://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        await serving


def _beat() -> Heartbeat:
    return Heartbeat(name="tls-node", address="127.0.0.1", inventory=InventoryWire(cpu_count=1))


async def test_the_heartbeat_verifies_the_server_with_the_ca_file(pki: Pki, https_url: str) -> None:
    client = ServerClient(https_url, NODE_TOKEN, 10.0, ca_file=pki.ca)
    try:
        reply = await client.heartbeat(_beat())
        assert reply.node_id.startswith("node-")
        assert client.node_id == reply.node_id
    finally:
        await client.aclose()


async def test_without_the_ca_file_it_says_what_to_set(https_url: str) -> None:
    client = ServerClient(https_url, NODE_TOKEN, 10.0)
    try:
        with pytest.raises(ServerTlsError) as exc:
            await client.heartbeat(_beat())
    finally:
        await client.aclose()
    msg = str(exc.value)
    assert msg.startswith(f"{https_url}: certificate verify failed (")
    assert "set HETEROFLOW_AGENT_CA_FILE" in msg


async def test_a_ca_that_did_not_sign_it_is_named(pki: Pki, https_url: str) -> None:
    client = ServerClient(https_url, NODE_TOKEN, 10.0, ca_file=pki.other_ca)
    try:
        with pytest.raises(ServerTlsError) as exc:
            await client.heartbeat(_beat())
    finally:
        await client.aclose()
    assert f"not signed by a CA in HETEROFLOW_AGENT_CA_FILE ({pki.other_ca})" in str(exc.value)


def test_the_agent_setting_and_an_unreadable_bundle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HETEROFLOW_AGENT_CA_FILE", str(tmp_path / "missing.pem"))
    settings = AgentSettings()
    assert settings.ca_file == tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=r"CA_FILE .*missing\.pem: not a readable"):
        tls_context(settings.ca_file)
    monkeypatch.setenv("HETEROFLOW_AGENT_CA_FILE", "")
    assert AgentSettings().ca_file is None  # "CA_FILE=" in an env file: the default
    assert tls_context(None) is True


def test_a_key_that_does_not_match_stops_the_start(
    pki: Pki, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`heteroflow server --tls-cert --tls-key`: a key of another pair is one line, exit 2."""
    d = tmp_path / "pki"
    d.mkdir()
    for name in ("ca.pem", "ca.key"):
        (d / name).write_bytes((pki.ca.parent / name).read_bytes())
    _, other_key = make_server_cert(d, "ca", "IP:127.0.0.1")  # a second key pair
    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("HETEROFLOW_DATABASE_URL", raising=False)
    argv = ["server", "--port", "0", "--tls-cert", str(pki.cert), "--tls-key", str(other_key)]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert "listening on https://" in out.out
    assert out.err.startswith("heteroflow server: HETEROFLOW_TLS_CERT_FILE / HETEROFLOW_TLS_KEY")
