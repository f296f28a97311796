"""issue 33: one running HeteroFlow per data directory, enforced by an OS lock.

A real ``heteroflow up`` holds its data directory; a second ``up`` on it — started as
the busy-port message suggests, with another ``--port`` — and a ``server`` on it are
refused at once in one line naming the running one (pid and URL), exit 2, before they
touch the database or the CLI's login. A holder that dies without a word (SIGKILL)
leaves no stale lock behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from heteroflow.cmd import instance_lock
from tests.conftest import free_port

CLI = [sys.executable, "-m", "heteroflow.cli"]
START_TIMEOUT_S = 60.0


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
    return {**env, "HETEROFLOW_CLI_DIR": str(tmp_path / "cli-second"), **extra}


def _refused(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=30)
    assert time.monotonic() - t0 < 15, "refused at once, not after a start"
    return done


def test_a_second_up_or_server_on_a_running_data_directory_is_refused(tmp_path: Path) -> None:
    data = tmp_path / "data"
    out = tmp_path / "first.out"
    first_env = _env(tmp_path, HETEROFLOW_CLI_DIR=str(tmp_path / "cli-first"))
    with out.open("w") as o:
        first = subprocess.Popen(
            [*CLI, "up", "--data-dir", str(data), "--demo", "none", "--port", "0"],
            stdout=o, stderr=subprocess.STDOUT, env=first_env, text=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "HeteroFlow server on http://" not in out.read_text():
            assert first.poll() is None, out.read_text()[-2000:]
            assert time.monotonic() < deadline, out.read_text()[-2000:]
            time.sleep(0.1)
        url = out.read_text().split("HeteroFlow server on ", 1)[1].split()[0]

        second = _refused(
            ["up", "--data-dir", str(data), "--demo", "none", "--port", str(free_port())],
            _env(tmp_path),
        )
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
        assert f"pid {first.pid}" in lines[0] and url in lines[0] and str(data) in lines[0]
        assert second.stdout == ""  # no password, no "server on", no demo
        assert not (tmp_path / "cli-second").exists()  # the CLI login is untouched

        server = _refused(["server", "--port", "0"], _env(tmp_path, HETEROFLOW_DATA_DIR=str(data)))
        assert server.returncode == 2 and f"pid {first.pid}" in server.stderr, server.stderr
        assert first.poll() is None  # the running one never noticed
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(30)
    # stopped: the data directory is free again
    instance_lock.acquire(data, "test", "http://x").release()


def test_a_holder_killed_without_a_word_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from heteroflow.cmd import instance_lock;"
         "instance_lock.acquire(Path(sys.argv[1]), 'up', 'http://127.0.0.1:1');"
         "print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        try:
            instance_lock.acquire(tmp_path, "up", "http://127.0.0.1:2")
        except SystemExit as exc:
            assert f"pid {holder.pid}" in str(exc) and "http://127.0.0.1:1" in str(exc)
        else:
            raise AssertionError("a held data directory was taken")
    finally:
        holder.kill()
        holder.wait(10)
    lock = instance_lock.acquire(tmp_path, "up", "http://127.0.0.1:2")  # no stale lock
    assert '"url": "http://127.0.0.1:2"' in (tmp_path / instance_lock.LOCK_FILE).read_text()
    lock.release()


def test_up_refuses_a_models_dir_that_does_not_exist(tmp_path: Path) -> None:
    done = _refused(
        ["up", "--data-dir", str(tmp_path / "data"), "--models-dir", str(tmp_path / "nope")],
        _env(tmp_path),
    )
    assert done.returncode == 1 and "--models-dir" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists() and not (tmp_path / "nope").exists()
