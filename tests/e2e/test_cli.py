"""The ``heteroflow`` CLI against a running server: login, create with progress, list, delete."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ADMIN_PASSWORD, Stack

pytestmark = pytest.mark.e2e


def cli(stack: Stack, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "HETEROFLOW_CLI_DIR": str(stack.tmp / "cli"),
        "HETEROFLOW_PASSWORD": ADMIN_PASSWORD,
    }
    r = subprocess.run(
        [sys.executable, "-m", "heteroflow.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if check:
        assert r.returncode == 0, r.stdout + r.stderr
    return r


@pytest.mark.feature("P3", "N1")
def test_cli_login_create_with_progress_list_show_delete(stack: Stack) -> None:
    assert "logged in" in cli(stack, "login", "--server", stack.server_url).stdout
    state = Path(stack.tmp / "cli" / "cli.json")
    assert oct(state.stat().st_mode & 0o777) == "0o600"

    out = cli(
        stack,
        "services",
        "create",
        "--name",
        "from-cli",
        "--image",
        "ghcr.io/ggml-org/llama.cpp:server",
        "--gpus",
        "0",
        "--model-path",
        str(stack.model_file),
        "--engine-arg=-c",
        "--engine-arg=512",
    ).stdout
    lines = out.splitlines()
    assert lines[0].startswith("created tg-")
    assert any(line.startswith("API key (shown once): sk-") for line in lines)
    # progress: "  [12s] starting — why", one line per change
    progress = [line.split()[1] for line in lines if line.startswith("  [")]
    assert progress[-1] == "running", out
    assert progress[0] in ("pending", "scheduling")
    assert lines[-1].endswith("is running")
    group_id = lines[0].split()[1]

    listed = cli(stack, "services", "list").stdout.splitlines()
    row = next(line.split() for line in listed if line.startswith(group_id))
    assert row[1:2] == ["from-cli"] and "running" in row
    shown = cli(stack, "services", "show", group_id).stdout
    assert "running" in shown and "->8000" in shown  # host->container, as Docker writes it
    nodes = cli(stack, "nodes").stdout.splitlines()
    assert any(line.split()[:2] == ["e2e-node", "online"] for line in nodes)
    status = cli(stack, "status", check=False)
    assert "nodes:    1 online, 0 offline" in status.stdout, status.stdout + status.stderr
    assert status.returncode == 0 and "nothing is wrong" in status.stdout

    bad = cli(stack, "services", "create", "--name", "bad name", "--image", "x", check=False)
    assert bad.returncode != 0 and "name" in bad.stderr

    assert f"deleted {group_id}" in cli(stack, "services", "delete", group_id).stdout
    missing = cli(stack, "services", "show", group_id, check=False)
    assert missing.returncode != 0 and "404" in missing.stderr
