"""``heteroflow up``: one command, a served model, instructions printed, clean Ctrl-C."""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import psutil
import pytest

pytestmark = pytest.mark.e2e


def engines_under(path: Path) -> list[int]:
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "heteroflow.engines.llamacpp_server" in cmd and str(path) in cmd:
            out.append(int(p.info["pid"]))
    return out


SECRET = "e2e-secret-that-must-stay-in-the-server"


def assert_owner_only(root: Path) -> None:
    """Every file ``up`` wrote (database, WAL, logs, engine logs) is 0600 and every
    directory it made 0700 — but the models folder, whose files are meant to be shared
    read-only with engines."""
    checked = 0
    for path in root.rglob("*"):
        if "models" in path.relative_to(root).parts:
            continue
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
        checked += path.is_file()
    assert checked >= 3, list(root.rglob("*"))  # at least the database, its WAL, a log


@pytest.mark.feature("P1", "M1")
def test_up_serves_the_demo_and_stops_cleanly(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "heteroflow.cli",
            "up",
            "--demo",
            "tiny",
            "--port",
            "0",
            "--data-dir",
            str(tmp_path),
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # secrets in the server's environment must never reach an engine (issue 10)
        env={**os.environ, "HETEROFLOW_JWT_SECRET": SECRET, "HETEROFLOW_NODE_TOKEN": SECRET},
    )
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    out = b""
    deadline = time.monotonic() + 60
    try:
        while b"Press Ctrl-C" not in out and time.monotonic() < deadline:
            if sel.select(timeout=0.5):
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                out += chunk
        text = out.decode()
        assert "Press Ctrl-C" in text, text
        key = re.search(r"API key \(shown once\): (sk-[0-9a-f-]{36})", text)
        base = re.search(r"gateway on (http://127\.0\.0\.1:\d+)", text)
        assert key and base, text
        assert "curl " in text and "from openai import OpenAI" in text
        # a small answer: without max_tokens a base model on 2 cores talks for minutes
        assert '"max_tokens": 32' in text and "max_tokens=32" in text
        assert re.search(r"admin password \(shown once\): \S+", text)

        client = openai.OpenAI(
            base_url=base.group(1) + "/v1", api_key=key.group(1), max_retries=3, timeout=30
        )
        reply = client.chat.completions.create(
            model="heteroflow-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].message.content
        engines = engines_under(tmp_path)
        assert engines, "the demo engine should be running"
        for pid in engines:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert SECRET.encode() not in environ
            assert b"HETEROFLOW_JWT_SECRET" not in environ
        assert_owner_only(tmp_path)
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(30)
    assert code == 0
    assert engines_under(tmp_path) == []
    # the admin password and the key went to the terminal only, never into a log file
    for log in tmp_path.rglob("*.log"):
        assert key.group(1) not in log.read_text(errors="replace")


@pytest.mark.parametrize("command", ["up", "server"])
def test_a_busy_port_is_one_clear_line_and_exit_code_2(tmp_path: Path, command: str) -> None:
    """Issue 12: a second `up` (or server) on a taken port printed a raw OSError
    traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = ["--port", str(port)]
        if command == "up":
            args += ["--demo", "tiny", "--data-dir", str(tmp_path)]
        proc = subprocess.run(
            [sys.executable, "-m", "heteroflow.cli", command, *args],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "HETEROFLOW_DATA_DIR": str(tmp_path / "server")},
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"127.0.0.1:{port} is already in use" in proc.stderr
    assert "Traceback" not in proc.stderr
