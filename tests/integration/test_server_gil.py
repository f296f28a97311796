"""A server process — `heteroflow server`, and `up`, which embeds one — hands the GIL over
every 1 ms (serving.share_the_gil): its heartbeat threads and event loop wait on I/O, and
each return from a wait took up to CPython's 5 ms while a controller computed
(docs/benchmarks.md, the control plane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from heteroflow.serving import GIL_SWITCH_INTERVAL_S

# Runs the CLI in this interpreter from CPython's interval; once the process has set its
# own (start-up done, about to serve) it reports it and is stopped as an operator would
# (SIGTERM): no timing involved.
_DRIVER = """
import json, os, signal, sys
from heteroflow import serving
from heteroflow.cli import main

sys.setswitchinterval(0.005)
real = serving.share_the_gil

def share_and_report():
    real()
    print(json.dumps({"switch_s": sys.getswitchinterval()}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

serving.share_the_gil = share_and_report
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("command", ["server", "up"])
def test_a_server_process_hands_the_gil_over_every_millisecond(
    tmp_path: Path, command: str
) -> None:
    assert GIL_SWITCH_INTERVAL_S != 0.005  # the driver starts from CPython's
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETEROFLOW_")}
    env["HETEROFLOW_CLI_DIR"] = str(tmp_path / "cli")
    if command == "server":
        env["HETEROFLOW_DATA_DIR"] = str(tmp_path / "data")
        args = ["server", "--port", "0", "--host", "127.0.0.1"]
    else:
        models = tmp_path / "models"
        models.mkdir()
        args = ["up", "--data-dir", str(tmp_path / "data"), "--models-dir", str(models)]
        args += ["--demo", "none", "--port", "0"]
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert reports, f"it never got to serve: {proc.returncode} {proc.stderr[-2000:]}"
    assert json.loads(reports[0])["switch_s"] == GIL_SWITCH_INTERVAL_S
