"""One root per process: ``heteroflow agent`` and ``heteroflow gateway``, started for
real, never load the server's code, the database, SQLAlchemy or FastAPI.

Each runs as its own process, through the console script's own entry point
(``heteroflow.cli.main``), until it says it has started; then it gets SIGTERM and, as it
exits, writes ``sys.modules``: every module that process loaded — the dispatcher, the
parsers, the root and whatever its start-up and first rounds imported lazily.
`.importlinter` holds the same rule on the import graph; this holds it on what a running
process really holds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

FORBIDDEN = (
    "heteroflow.server",
    "heteroflow.db",
    "heteroflow.services",
    "heteroflow.api",
    "heteroflow.controllers",
    "sqlalchemy",
    "fastapi",
)
START_TIMEOUT_S = 60.0
# `heteroflow ARGS...` as the console script runs it, writing sys.modules to DUMP at exit
HETEROFLOW = (
    "import atexit, json, sys\n"
    "from heteroflow.cli import main\n"
    "dump = sys.argv[1]\n"
    "atexit.register(lambda: open(dump, 'w').write(json.dumps(sorted(sys.modules))))\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def _forbidden(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == f or m.startswith(f"{f}.") for f in FORBIDDEN))


def _start_and_stop(
    args: list[str], started: str, tmp_path: Path, env: dict[str, str]
) -> set[str]:
    """Run ``heteroflow ARGS`` until stdout says ``started``, then SIGTERM; the modules
    it had loaded when it exited. Its output goes to files: a pipe nobody reads could
    fill and stall it."""
    out, err, dump = tmp_path / "stdout", tmp_path / "stderr", tmp_path / "modules.json"
    with out.open("w") as o, err.open("w") as e:
        proc = subprocess.Popen(
            [sys.executable, "-c", HETEROFLOW, str(dump), *args],
            stdout=o, stderr=e, env={**os.environ, **env}, text=True,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while started not in out.read_text():
                assert proc.poll() is None, f"it exited: {err.read_text()[-2000:]}"
                assert time.monotonic() < deadline, f"it did not start: {out.read_text()}"
                time.sleep(0.1)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, err.read_text()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return set(json.loads(dump.read_text()))


def test_an_agent_process_loads_no_server_code(tmp_path: Path) -> None:
    env = {
        "HETEROFLOW_AGENT_SERVER_URL": f"http://127.0.0.1:{free_port()}",  # nobody there
        "HETEROFLOW_AGENT_NODE_TOKEN": "node-token",
        "HETEROFLOW_AGENT_WORK_DIR": str(tmp_path / "agent"),
        "HETEROFLOW_AGENT_NODE_NAME": "roots-test",
    }
    modules = _start_and_stop(
        ["agent", "--runtime", "process"], "HeteroFlow agent roots-test", tmp_path, env
    )
    assert {"heteroflow.cmd.agent", "heteroflow.agent.daemon"} <= modules
    assert _forbidden(modules) == []


@pytest.mark.parametrize("mode", ["standalone", "server"])
def test_a_gateway_process_loads_no_server_code(tmp_path: Path, mode: str) -> None:
    if mode == "standalone":
        routes = tmp_path / "routes.json"
        backend = f"http://127.0.0.1:{free_port()}/v1"
        routes.write_text(json.dumps({
            "models": {"chat": {"algorithm": "least_connections", "backends": [backend]}},
            "keys": {},
        }))
        args = ["--routes", str(routes)]
    else:  # polls a server that is not there: it still starts
        args = ["--server", f"http://127.0.0.1:{free_port()}", "--token", "gateway-token"]
    modules = _start_and_stop(
        ["gateway", "--port", "0", *args], "HeteroFlow gateway listening", tmp_path, {}
    )
    assert {"heteroflow.cmd.gateway", "heteroflow.gateway.app"} <= modules
    assert _forbidden(modules) == []


def test_the_server_root_is_what_loads_it() -> None:
    """The check sees server code where there is some: the server's root loads
    heteroflow.server, the database layer, SQLAlchemy and FastAPI."""
    code = "import json, sys, heteroflow.cmd.server; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert {"heteroflow.server", "heteroflow.db", "sqlalchemy", "fastapi"} <= set(
        _forbidden(set(json.loads(out)))
    )
