"""The agent's sleep and wake convergence (F1, F2, F3, D2, D4, C2, C8) on a fake clock.

A fake server client (heartbeat replies the test writes), a fake runtime and launcher,
and a fake probe: every branch of ``Agent.tick`` / ``watch_once`` for sleeping and
waking tasks, without a network or a process. The real runtimes are exercised by
tests/integration/test_sleep_wake_agent.py (processes) and tests/docker/ (containers).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent import daemon, watch
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import NodeInventory, NvmlDiscovery
from heteroflow.agent.launch import NoDoors
from heteroflow.agent.runtime.protocol import ContainerGone
from heteroflow.core.clock import FakeClock
from heteroflow.core.health import HealthCheckConfig
from heteroflow.schemas.nodes import Heartbeat, HeartbeatReply, TaskAssignment
from heteroflow.schemas.sleep import NodeTaskLife
from heteroflow.settings import AgentSettings

TASK = "task-0123456789ab"
CHECK = {"interval_seconds": 10, "start_period_seconds": 60, "unhealthy_threshold": 3}


def assignment(status: str, task_id: str = TASK, **over: Any) -> TaskAssignment:
    fields: dict[str, Any] = {
        "id": task_id, "group_id": "tg-0123456789ab", "name": "svc-0", "status": status,
        "task_type": "inference", "model_name": "m", "model_path": "/m/tiny.gguf",
        "image": "img", "engine": "llamacpp", "command": [], "engine_args": [], "env": [],
        "ports": [{"container_port": 8000, "host_port": 21000, "from_pool": True}],
        "gpu_ids": [], "gpu_required": 0, "memory_mb": 0, "health_check": dict(CHECK),
    }
    fields.update(over)
    return TaskAssignment(**fields)


class FakeClient:
    def __init__(self) -> None:
        self.tasks: list[TaskAssignment] = []
        self.reports: list[tuple[str, str, str, str | None]] = []
        self.notes: list[tuple[str, str, str]] = []  # D5: (status, note, message)
        self.life = NodeTaskLife()
        self.node_id = "node-1"

    async def heartbeat(self, hb: Heartbeat) -> HeartbeatReply:
        return HeartbeatReply(node_id=self.node_id, tasks=list(self.tasks))

    async def report(
        self, task_id: str, status: str, message: str = "", argv: Any = None,
        fault: str | None = None, busy_ports: tuple[int, ...] = (), note: str | None = None,
    ) -> str:
        if note is not None:
            self.notes.append((status, note, message))
        else:
            self.reports.append((task_id, status, message, fault))
        return status

    async def claim(self, task_id: str) -> TaskAssignment:
        t = next(x for x in self.tasks if x.id == task_id)
        return t.model_copy(update={"status": "starting"})

    async def task_life(self) -> NodeTaskLife:
        return self.life

    async def aclose(self) -> None:
        pass


class FakeRuntime:
    """Engines by task id: "running", "exited" (a kept container) or absent."""

    def __init__(self, name: str = "docker") -> None:
        self.name = name
        self.state: dict[str, str] = {}
        self.calls: list[str] = []
        self.gone_at_wake = False

    def exit_code(self, task_id: str) -> int | None:
        state = self.state.get(task_id)
        return None if state == "running" else (0 if state == "exited" else -1)

    def halt(self, task_id: str, timeout_s: float) -> None:
        self.calls.append(f"halt {task_id}")
        if self.name == "docker":
            self.state[task_id] = "exited"
        else:
            self.state.pop(task_id, None)

    def stop(self, task_id: str, timeout_s: float) -> None:
        self.calls.append(f"stop {task_id}")
        self.state.pop(task_id, None)

    def remove(self, task_id: str) -> None:
        self.calls.append(f"remove {task_id}")
        self.state.pop(task_id, None)

    def managed(self) -> dict[str, str]:
        return dict(self.state)

    def forget(self, task_id: str) -> None:
        pass

    def log_tail(self, task_id: str, lines: int) -> str:
        return ""


class FakeLauncher(NoDoors):
    probe_host = "127.0.0.1"

    def __init__(self, runtime: FakeRuntime) -> None:
        self.runtime = runtime
        self.resumed: list[str] = []

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        self.runtime.state[t.id] = "running"
        return ("engine", t.id)

    def resume(self, t: TaskAssignment) -> tuple[str, ...]:
        if self.runtime.gone_at_wake:
            raise ContainerGone(f"container {t.id} gone at wake")
        self.resumed.append(t.id)
        self.runtime.state[t.id] = "running"
        return ()

    def engines(self) -> dict[str, str]:
        return {"llamacpp": ""}

    def observe(self, inv: NodeInventory) -> None:
        pass

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


class NoLogs:
    async def ship_once(self, task_ids: list[str]) -> None:
        pass

    def forget(self, task_id: str) -> None:
        pass


class Probe:
    """The health probe's answers, in order (True = pass); records the ports probed."""

    def __init__(self) -> None:
        self.ok = True
        self.calls = 0

    async def __call__(
        self, config: HealthCheckConfig, host: str, port: int, session: Any = None, key: str = ""
    ) -> tuple[bool, str]:
        self.calls += 1
        return self.ok, "HTTP 200" if self.ok else "connection refused"


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Probe:
    p = Probe()
    monkeypatch.setattr(watch, "probe", p)  # where the watch loop looks it up
    inv = NodeInventory((), 2, 1024, 1024, 0.0, 0.0)
    monkeypatch.setattr(daemon, "collect_inventory", lambda gpus, nvml: inv)
    monkeypatch.setattr(daemon, "listening_ports", lambda: [])
    monkeypatch.setattr(Agent, "_session", lambda self: None)  # the fake probe needs none
    return p


def make(tmp_path: Path, runtime_name: str = "docker") -> tuple[Agent, FakeClient, FakeRuntime]:
    runtime = FakeRuntime(runtime_name)
    settings = AgentSettings(
        server_url="http://server", node_token="t", node_name="node-a", runtime="process",
        work_dir=tmp_path / "agent", load_stall_s=120, wake_probe_interval_s=0.2,
    )
    agent = Agent(
        settings, NodeConfig(), FakeLauncher(runtime), FakeClock(),  # type: ignore[arg-type]
        nvml=NvmlDiscovery(platform="none"),
    )
    client = FakeClient()
    agent.client = client  # type: ignore[assignment]
    agent.shipper = NoLogs()  # type: ignore[assignment]
    agent.beats = 1  # past the first full model scan
    return agent, client, runtime


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def running_here(agent: Agent, client: FakeClient, runtime: FakeRuntime) -> None:
    """A task this agent runs, reported running."""
    t = assignment("running")
    runtime.state[TASK] = "running"
    agent._adopt(t)
    client.tasks = [t]


@pytest.mark.feature("F1", "D2")
def test_a_sleeping_task_has_its_engine_stopped_and_kept_and_is_never_lost(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    running_here(agent, client, runtime)
    client.tasks = [assignment("sleeping")]
    run(agent.tick())
    assert runtime.calls == [f"halt {TASK}"]  # stopped, not removed: kept for the wake
    assert runtime.state[TASK] == "exited"
    assert TASK not in agent.local and agent.asleep[TASK].tracker.paused
    for _ in range(3):  # later looks: no "lost" report, no zombie removal, no relaunch
        run(agent.tick())
        run(agent.watch_once())
    assert client.reports == [] and runtime.calls == [f"halt {TASK}"]
    assert runtime.state[TASK] == "exited" and probe.calls == 0


@pytest.mark.feature("F1")
def test_after_an_agent_restart_a_sleeping_task_is_held_asleep(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    runtime.state[TASK] = "exited"  # its kept container, from before the restart
    client.tasks = [assignment("sleeping")]
    run(agent.tick())
    assert runtime.calls == [] and TASK in agent.asleep and client.reports == []
    # one still running (the agent died mid-sleep) is put to sleep now
    agent2, client2, runtime2 = make(tmp_path)
    runtime2.state[TASK] = "running"
    client2.tasks = [assignment("sleeping")]
    run(agent2.tick())
    assert runtime2.calls == [f"halt {TASK}"]


@pytest.mark.feature("F2", "C2", "D2")
def test_a_waking_task_resumes_and_is_reported_running_at_its_first_pass(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    running_here(agent, client, runtime)
    client.tasks = [assignment("sleeping")]
    run(agent.tick())
    client.tasks = [assignment("waking")]
    probe.ok = False  # the engine is still loading
    run(agent.tick())
    assert agent.launcher.resumed == [TASK]  # type: ignore[attr-defined]
    loc = agent.local[TASK]
    assert loc.waking and not loc.tracker.paused and loc.tracker.consecutive_failures == 0
    run(agent.watch_once())  # probed at once: fails inside the fresh start period
    assert client.reports == []
    agent.clock.advance(0.3)  # type: ignore[attr-defined]
    run(agent.watch_once())  # a quick probe, well before the 10 s check interval
    assert probe.calls == 2
    probe.ok = True
    agent.clock.advance(0.3)  # type: ignore[attr-defined]
    run(agent.watch_once())
    [(task_id, status, message, fault)] = client.reports
    assert (task_id, status, fault) == (TASK, "running", None)
    assert message.startswith("awake: health check passed 0.6 s after its wake; loaded in")
    assert not agent.local[TASK].waking and agent.local[TASK].load is None
    # F1: how it sleeps, said on the sleeping task; D5: the wake's load window opened
    # with a note on the waking task
    assert [(s, n) for s, n, _ in client.notes] == [("sleeping", "asleep"), ("waking", "loading")]
    assert client.notes[0][2].startswith("asleep: engine stopped (")


@pytest.mark.feature("F2", "D5")
def test_a_woken_engine_whose_load_stalls_fails_its_task_with_the_reason(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    runtime.state[TASK] = "exited"
    # after an agent restart a waking task is resumed all the same; no fixed limit now:
    # nothing moves (no bytes counted, a silent log), so it stalls after load_stall_s
    check = {**CHECK, "start_period_seconds": 30}
    client.tasks = [assignment("waking", health_check=check)]
    run(agent.tick())
    assert agent.local[TASK].waking
    probe.ok = False
    looks = 0
    while TASK in agent.local and looks < 60:
        agent.clock.advance(5)  # type: ignore[attr-defined]
        run(agent.watch_once())
        looks += 1
    assert looks == 120 // 5  # not a moment before load_stall_s of nothing
    assert client.reports[-1][1:] == (
        "failed",
        "stalled: no progress for 120 s (its wake); last health check: connection refused",
        "load_stalled",
    )
    assert f"stop {TASK}" in runtime.calls  # the container is removed: it is rebuilt


@pytest.mark.feature("F3", "C2")
def test_a_container_gone_at_wake_fails_the_task_with_container_lost(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    running_here(agent, client, runtime)
    client.tasks = [assignment("sleeping")]
    run(agent.tick())
    runtime.state.pop(TASK)  # removed behind the agent's back while asleep
    runtime.gone_at_wake = True
    client.tasks = [assignment("waking")]
    run(agent.tick())
    assert client.reports == [(TASK, "failed", "container gone at wake", "container_lost")]
    assert TASK not in agent.local and TASK not in agent.asleep


@pytest.mark.feature("F1", "C8")
def test_a_task_stopped_while_asleep_loses_its_kept_container(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    running_here(agent, client, runtime)
    client.tasks = [assignment("sleeping")]
    run(agent.tick())
    client.tasks = []  # stopped or deleted: no longer listed
    run(agent.tick())
    assert runtime.calls == [f"halt {TASK}", f"stop {TASK}"]
    assert TASK not in runtime.state and TASK not in agent.asleep
    assert client.reports == [(TASK, "stopped", "stopped while asleep", None)]


@pytest.mark.feature("F2")
def test_a_sleep_and_a_wake_between_two_looks_only_report_running_again(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    running_here(agent, client, runtime)
    agent.local[TASK].reported_running = True
    client.tasks = [assignment("waking")]  # it never looked "sleeping" to this agent
    run(agent.tick())
    assert runtime.calls == [] and agent.local[TASK].waking
    run(agent.watch_once())
    assert client.reports[0][:2] == (TASK, "running")


@pytest.mark.feature("D4")
def test_a_health_check_changed_alone_applies_at_the_next_heartbeat(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    running_here(agent, client, runtime)
    changed = {**CHECK, "interval_seconds": 2, "path": "/ready"}
    client.tasks = [assignment("running", health_check=changed)]
    run(agent.tick())
    loc = agent.local[TASK]
    assert loc.health.interval_s == 2 and loc.health.path == "/ready"
    assert loc.tracker.config is loc.health and runtime.calls == []  # no restart


def test_the_light_poll_asks_for_a_heartbeat_only_when_something_changed(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime = make(tmp_path)
    running_here(agent, client, runtime)
    assert not agent._life_wants_beat(NodeTaskLife())
    assert agent._life_wants_beat(NodeTaskLife(sleeping=[TASK]))  # to put to sleep
    client.tasks = [assignment("sleeping")]
    run(agent.tick())
    assert not agent._life_wants_beat(NodeTaskLife(sleeping=[TASK]))  # done already
    assert agent._life_wants_beat(NodeTaskLife(waking=[TASK]))  # to start again
    assert agent._life_wants_beat(NodeTaskLife())  # stopped while asleep


def test_the_light_poll_nudges_the_heartbeat_loop(tmp_path: Path, probe: Probe) -> None:
    agent, client, runtime = make(tmp_path)
    agent.settings.task_life_poll_interval_s = 0.01
    agent.settings.heartbeat_interval_s = 3600
    running_here(agent, client, runtime)
    client.life = NodeTaskLife(sleeping=[TASK])
    client.tasks = [assignment("sleeping")]

    async def drive() -> None:
        stop = asyncio.Event()
        loop = asyncio.create_task(agent._life_loop(stop))
        paused = asyncio.create_task(agent._pause(stop, 3600))
        done, _ = await asyncio.wait({paused}, timeout=5)
        stop.set()
        await loop
        assert done, "the light poll did not end the wait for the next heartbeat"
        assert not paused.result()  # a nudge, not a stop

    run(drive())
