"""A running agent warns once at start about a retired setting still set (D5)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from .test_agent_metrics import FakeClient, make


def test_the_agent_warns_at_start_about_a_retired_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HETEROFLOW_AGENT_WAKE_READY_TIMEOUT_S", "600")
    agent = make(tmp_path, FakeClient([], fail_beats=1_000_000), heartbeat_interval_s=0.05)

    async def drive() -> None:
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop))
        await asyncio.sleep(0.1)
        stop.set()
        await running

    with caplog.at_level(logging.WARNING, logger="heteroflow.agent.daemon"):
        asyncio.run(drive())
    lines = [r.getMessage() for r in caplog.records if "WAKE_READY_TIMEOUT_S" in r.getMessage()]
    assert len(lines) == 1 and "HETEROFLOW_AGENT_LOAD_STALL_S" in lines[0]
