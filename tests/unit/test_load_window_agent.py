"""D5 in the agent, on a fake clock: the start window follows the load.

The agent of tests/unit/test_sleep_agent.py (fake server client, runtime, launcher and
probe) with a scripted ``ProgressSource``: a launched engine that keeps reading is never
stopped for being slow, however long past its fixed start window; one whose load stops
moving is stopped after ``load_stall_s`` with the reason; what it reads is said in its
status message; after its first pass D2's rules apply unchanged; a training task keeps
D2's fixed window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent import daemon, watch
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import NodeInventory
from heteroflow.agent.load_progress import READ_RATE_FILE
from heteroflow.core.engines.load_words import words_for
from heteroflow.core.health import HealthCheckConfig
from heteroflow.core.loading import MB, LoadPolicy, LoadSample
from heteroflow.schemas.nodes import TaskAssignment

from .test_sleep_agent import TASK, FakeClient, FakeRuntime, assignment, make, run

# the old-style window: 5 s start period, then 3 failures 1 s apart would kill it at ~8 s
CHECK = {"interval_seconds": 1, "start_period_seconds": 5, "unhealthy_threshold": 3}
MODEL_BYTES = 540 * MB


class Probe:
    def __init__(self) -> None:
        self.ok = False
        self.detail = "HTTP 503: Loading model"  # what llama.cpp answers while it loads

    async def __call__(
        self, config: HealthCheckConfig, host: str, port: int, session: Any = None, key: str = ""
    ) -> tuple[bool, str]:
        return self.ok, "HTTP 200" if self.ok else self.detail


class Progress:
    """The engine's load as the test scripts it: bytes read so far."""

    def __init__(self) -> None:
        self.read = 0
        self.samples = 0

    def sample(self, t: TaskAssignment, at: float, detail: str, disk: str | None) -> LoadSample:
        self.samples += 1
        words = words_for(t.engine)
        return LoadSample(at=at, read_bytes=self.read, says_loading=words.says_loading(detail))

    def forget(self, task_id: str) -> None:
        pass


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Probe:
    p = Probe()
    monkeypatch.setattr(watch, "probe", p)
    inv = NodeInventory((), 2, 1024, 1024, 0.0, 0.0)
    monkeypatch.setattr(daemon, "collect_inventory", lambda gpus, nvml: inv)
    monkeypatch.setattr(daemon, "listening_ports", lambda: [])
    monkeypatch.setattr(Agent, "_session", lambda self: None)
    return p


def launched(tmp_path: Path, **over: Any) -> tuple[Agent, FakeClient, FakeRuntime, Progress]:
    """A task claimed and launched by the agent, its model a real file of MODEL_BYTES."""
    model = tmp_path / "big.gguf"
    with open(model, "wb") as f:
        f.truncate(MODEL_BYTES)
    agent, client, runtime = make(tmp_path)
    agent.load_policy = LoadPolicy(stall_s=20, ceiling_s=3600)
    progress = Progress()
    agent.progress = progress
    fields: dict[str, Any] = {"model_path": str(model), "health_check": dict(CHECK), **over}
    client.tasks = [assignment("scheduled", **fields)]
    run(agent.tick())
    assert runtime.state[TASK] == "running"
    return agent, client, runtime, progress


def step(agent: Agent, seconds: float) -> None:
    agent.clock.advance(seconds)  # type: ignore[attr-defined]
    run(agent.watch_once())


@pytest.mark.feature("D5")
def test_a_slow_load_that_reads_outlives_the_fixed_window_and_is_told(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime, progress = launched(tmp_path)
    loc = agent.local[TASK]
    assert loc.load is not None
    [(status, note, message)] = client.notes
    assert (status, note) == ("starting", "loading")
    assert message == (
        "loading a 540 MB model: expected ~3 s at 200 MB/s, default: no load measured here yet"
    )
    for _ in range(60):  # a minute at 9 MB/s: twenty times past the old window
        progress.read += 9 * MB
        step(agent, 1)
        assert TASK in agent.local, client.reports
    assert client.reports == [] and runtime.calls == []
    assert loc.tracker.consecutive_failures == 0
    told = [m for s, n, m in client.notes if n == "progress"]
    assert len(told) == 5  # every load_report_interval_s (10 s)
    assert told[0] == "loading: 99 of 540 MB, ~49 s left; the engine says it is loading"
    assert told[-1] == "loading: 459 of 540 MB, ~9 s left; the engine says it is loading"
    probe.ok = True
    step(agent, 1)
    [(_, status, message, fault)] = client.reports
    assert (status, fault) == ("running", None)
    assert message == "health check passed; loaded in 61 s (540 MB read at 9 MB/s)"
    assert loc.load is None
    assert agent.read_rate.measured and round(agent.read_rate.bps / MB) == 9
    again, _, _ = make(tmp_path)  # an agent restarted on this node remembers it
    assert again.read_rate.measured and round(again.read_rate.bps) == round(agent.read_rate.bps)
    (tmp_path / "agent" / READ_RATE_FILE).write_text("{not json")
    assert not make(tmp_path)[0].read_rate.measured  # unreadable: the default
    # after the first pass D2's rules apply unchanged: three failures and it is stopped
    probe.ok = False
    for _ in range(3):
        progress.read += 9 * MB  # reading does not save a served engine
        step(agent, 1)
    assert client.reports[-1][1:] == (
        "failed", "health check failed 3 times: HTTP 503: Loading model", "unhealthy"
    )


@pytest.mark.feature("D5")
def test_a_load_that_stops_moving_is_stopped_with_the_reason(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, runtime, progress = launched(tmp_path)
    for _ in range(10):
        progress.read += 10 * MB
        step(agent, 1)
    stalled_at = agent.clock.monotonic()
    while TASK in agent.local:
        step(agent, 1)
        assert agent.clock.monotonic() - stalled_at <= 21, "not stopped after load_stall_s"
    assert agent.clock.monotonic() - stalled_at >= 20  # not a moment before
    assert client.reports == [(
        TASK, "failed",
        "stalled: no progress for 20 s after reading 100 of 540 MB (its launch); "
        "last health check: HTTP 503: Loading model",
        "load_stalled",
    )]
    assert runtime.calls == [f"stop {TASK}"]
    assert not agent.read_rate.measured


@pytest.mark.feature("D5")
def test_a_hung_engine_that_reads_nothing_is_stopped_after_its_start_period_and_stall(
    tmp_path: Path, probe: Probe
) -> None:
    agent, client, _, _ = launched(tmp_path, health_check={**CHECK, "start_period_seconds": 30})
    probe.detail = "connection refused"  # vLLM's way of loading, or nothing at all
    start = agent.clock.monotonic()
    while TASK in agent.local:
        step(agent, 1)
        assert agent.clock.monotonic() - start <= 31
    # its start period is its owner's minimum (sampled every 2 s: the first look after it)
    assert agent.clock.monotonic() - start >= 30
    [(_, status, message, fault)] = client.reports
    assert (status, fault) == ("failed", "load_stalled")
    assert message == (
        "stalled: no progress for 31 s after reading 0 of 540 MB (its launch); "
        "last health check: connection refused"
    )


def test_a_training_task_keeps_the_fixed_window(tmp_path: Path, probe: Probe) -> None:
    agent, client, _, progress = launched(tmp_path, task_type="training")
    assert agent.local[TASK].load is None and client.notes == []
    start = agent.clock.monotonic()
    while TASK in agent.local:
        progress.read += 10 * MB
        step(agent, 1)
        assert agent.clock.monotonic() - start <= 10
    assert client.reports[-1][2:] == (
        "health check failed 3 times: HTTP 503: Loading model", "unhealthy"
    )
    assert progress.samples == 0
