"""An engine that outlived its agent (C8 for the process runtime): the agent's death
signal is a SIGTERM nothing follows up, so an engine that ignores it keeps its port and
its card. A runtime made on the same work dir — the agent started again — kills what the
last one left (its whole process group), and only that: a pid taken since by another
process is told apart by its start time."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec

# an engine that will not stop on SIGTERM (and a child of its own, in its group)
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
time.sleep(120)
"""


def _gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # dead, waiting for its parent (this test) to reap it
            return True
        time.sleep(0.05)
    return False


def _children(pid: int) -> list[int]:
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


@pytest.mark.feature("C8")
def test_a_restarted_runtime_kills_the_engines_the_last_one_left(tmp_path: Path) -> None:
    first = ProcessRuntime(tmp_path / "agent")
    first.start(LaunchSpec("task-stubborn", (sys.executable, "-c", STUBBORN)))
    pid = first.pid("task-stubborn")
    assert pid is not None
    deadline = time.monotonic() + 10
    while not _children(pid):
        assert time.monotonic() < deadline, "the engine's own child never started"
        time.sleep(0.05)
    (child,) = _children(pid)
    # an unrelated process that has a recorded pid, but not that pid's start time
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
    )
    run = tmp_path / "agent" / "run"
    (run / "task-reused").write_text(f"{bystander.pid} 1\n")
    (run / "task-exited").write_text("999999999 5\n")  # no such process any more
    try:
        second = ProcessRuntime(tmp_path / "agent")  # the agent, started again
        assert second.orphans_killed == ["task-stubborn"]
        assert _gone(pid) and _gone(child)  # the engine's whole group
        assert bystander.poll() is None  # not ours: left alone
        assert sorted(p.name for p in run.iterdir()) == []  # every record dealt with
    finally:
        bystander.kill()
        bystander.wait()
        first.stop("task-stubborn", 1)


def test_a_forgotten_task_leaves_no_record(tmp_path: Path) -> None:
    rt = ProcessRuntime(tmp_path / "agent")
    rt.start(LaunchSpec("task-a", (sys.executable, "-c", "import time; time.sleep(60)")))
    assert (tmp_path / "agent" / "run" / "task-a").is_file()
    rt.remove("task-a")  # stopped and forgotten
    assert not (tmp_path / "agent" / "run" / "task-a").exists()
    assert ProcessRuntime(tmp_path / "agent").orphans_killed == []
