"""A server process hands the GIL over every 1 ms (serving.share_the_gil): its heartbeat
threads and event loop wait on I/O, and each return from a wait took up to CPython's
5 ms while a controller computed (docs/benchmarks.md, the control plane)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from heteroflow.serving import GIL_SWITCH_INTERVAL_S

# Runs `heteroflow server` in this interpreter; when the process settles its heap (start-up
# done, about to serve) it reports its switch interval and is stopped as an operator
# would (SIGTERM): no timing involved.
_DRIVER = """
import json, os, signal, sys
from heteroflow import serving
from heteroflow.cli import main

sys.setswitchinterval(0.005)  # CPython's, whatever this interpreter was given

real = serving.settle_heap

def settle_and_report():
    real()
    print(json.dumps({"switch_s": sys.getswitchinterval()}), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

serving.settle_heap = settle_and_report
sys.exit(main(sys.argv[1:]))
"""


def test_the_server_process_hands_the_gil_over_every_millisecond(tmp_path: Path) -> None:
    assert GIL_SWITCH_INTERVAL_S != 0.005  # the driver starts from CPython's
    env = {
        **os.environ,
        "HETEROFLOW_DATA_DIR": str(tmp_path / "data"),
        "HETEROFLOW_DATABASE_URL": "",
        "HETEROFLOW_ADMIN_PASSWORD": "gil-test-password-1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, "server", "--port", "0", "--host", "127.0.0.1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert reports, f"the server never settled: {proc.returncode} {proc.stderr[-2000:]}"
    assert json.loads(reports[0])["switch_s"] == GIL_SWITCH_INTERVAL_S
