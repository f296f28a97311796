"""The agent's side of image pulls (H7), on a stand-in runtime: a launch that may pull
runs beside the heartbeat, its progress is noted on the task, a failed pull is reported
with its reason (and the fault that stops recovery for a permanent one), and a report the
server asks to send again is kept. The real Engine: tests/docker/test_registry_pull.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.client import ServerError
from heteroflow.agent.daemon import Agent
from heteroflow.agent.runtime.protocol import PullFailed
from heteroflow.core.images import PullFailure, PullProgress
from heteroflow.schemas.nodes import TaskAssignment
from tests.unit.test_sleep_agent import (  # noqa: F401 (probe: a fixture)
    FakeClient,
    FakeLauncher,
    FakeRuntime,
    Probe,
    assignment,
    make,
    probe,
)

pytestmark = pytest.mark.feature("H7")
IMAGE = "reg:5000/team/engine:v2"


class PullingLauncher(FakeLauncher):
    """Pulls (``prepare``) until ``gate`` opens, telling its progress; or fails."""

    def __init__(self, runtime: FakeRuntime, fail: PullFailed | None = None) -> None:
        super().__init__(runtime)
        self.gate = threading.Event()
        self.fail = fail
        self.prepared: list[str] = []

    def prepare(self, t: TaskAssignment, progress: Callable[[PullProgress], None]) -> bool:
        self.prepared.append(t.id)
        p = PullProgress(t.image)
        p.feed({"status": "Downloading", "id": "a",
                "progressDetail": {"current": 1_200_000_000, "total": 4_500_000_000}})
        progress(p)
        self.gate.wait(5)
        if self.fail is not None:
            raise self.fail
        return True


def agent_with(tmp_path: Path, launcher: PullingLauncher) -> tuple[Agent, FakeClient]:
    agent, client, _runtime = make(tmp_path)
    agent.launcher = launcher  # type: ignore[assignment]
    agent.runtime = launcher.runtime  # type: ignore[assignment]
    return agent, client


def scheduled(task_id: str) -> TaskAssignment:
    return assignment("scheduled", task_id, image=IMAGE)


def test_launches_that_pull_run_beside_the_heartbeat_and_note_their_progress(
    tmp_path: Path, probe: Probe  # noqa: F811
) -> None:
    runtime = FakeRuntime()
    launcher = PullingLauncher(runtime)
    agent, client = agent_with(tmp_path, launcher)
    a, b = "task-00000000000a", "task-00000000000b"
    client.tasks = [scheduled(a), scheduled(b)]

    async def go() -> None:
        await agent.tick()  # both claimed; the pulls wait: the tick returned anyway
        assert set(agent.launching) == {a, b} and not agent.local
        await agent.tick()  # the node keeps beating; a launching task is left alone
        assert set(agent.launching) == {a, b}
        for _ in range(100):
            if len(client.notes) >= 2:
                break
            await asyncio.sleep(0.01)
        launcher.gate.set()
        for _ in range(200):
            if not agent.launching:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    assert set(agent.local) == {a, b} and sorted(launcher.prepared) == [a, b]
    assert ("starting", "pull", f"pulling image {IMAGE}") in client.notes
    done = [m for s, n, m in client.notes if n == "pull" and m.startswith("pulled image")]
    assert len(done) == 2 and all("4.5 GB in" in m for m in done)
    assert [r for r in client.reports if r[1] == "scheduled"] == []  # never "gone"


@pytest.mark.parametrize(
    ("kind", "fault"),
    [(PullFailure.NOT_FOUND, "image_unavailable"), (PullFailure.UNAUTHORISED,
                                                     "image_unavailable"),
     (PullFailure.TIMEOUT, None), (PullFailure.DISK_FULL, None)],
)
def test_a_failed_pull_fails_the_task_with_its_reason(
    tmp_path: Path, probe: Probe, kind: PullFailure, fault: str | None  # noqa: F811
) -> None:
    runtime = FakeRuntime()
    launcher = PullingLauncher(runtime, fail=PullFailed(IMAGE, kind, "the registry said so"))
    launcher.gate.set()
    agent, client = agent_with(tmp_path, launcher)
    t = "task-00000000000c"
    client.tasks = [scheduled(t)]

    async def go() -> None:
        await agent.tick()
        for _ in range(200):
            if not agent.launching:
                break
            await asyncio.sleep(0.01)

    asyncio.run(go())
    [(task_id, status, message, reported_fault)] = client.reports
    label = kind.value.replace("_", " ")
    assert (task_id, status, reported_fault) == (t, "failed", fault)
    assert message.startswith(f"image pull failed ({label}): {IMAGE}")
    assert runtime.state == {} and not agent.local


def test_a_report_the_server_asks_again_for_is_kept(tmp_path: Path) -> None:
    agent, client, _ = make(tmp_path)
    answers: list[Exception | None] = [
        ServerError(409, "task task-00000000000d changed concurrently; report again"), None,
    ]
    sent: list[str] = []

    async def report(task_id: str, status: str, *args: Any, **kw: Any) -> str:
        sent.append(status)
        error = answers.pop(0)
        if error is not None:
            raise error
        return status

    client.report = report  # type: ignore[method-assign]

    async def go() -> None:
        await agent._report("task-00000000000d", "running", "health check passed")
        assert "task-00000000000d" in agent.outbox  # kept for the next round
        await agent._flush_outbox()

    asyncio.run(go())
    assert sent == ["running", "running"] and agent.outbox == {}


def test_a_report_the_server_moved_past_is_dropped(tmp_path: Path) -> None:
    agent, client, _ = make(tmp_path)

    async def report(task_id: str, status: str, *args: Any, **kw: Any) -> str:
        raise ServerError(409, "task task-00000000000e is stopped; cannot report running")

    client.report = report  # type: ignore[method-assign]
    asyncio.run(agent._report("task-00000000000e", "running", "health check passed"))
    assert agent.outbox == {}
