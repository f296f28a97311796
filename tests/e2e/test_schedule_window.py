"""Schedule windows end to end (K1): real ``heteroflow server``, ``heteroflow agent``
(process runtime, the real llama.cpp engine on a tiny model) and a separate ``heteroflow
gateway``; requests through the OpenAI SDK.

The executor runs every 0.5 s here (``HETEROFLOW_SCHEDULE_WINDOW_INTERVAL_S``) instead
of 60 s. Proven: a window that does not include the current time pauses a running
service — it sleeps and its engine process is gone — and moving the window to include
now resumes it: it runs again (woken by the window, not by a request: none is sent while
it is paused) and answers through the gateway. The figures are printed (``-s``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import openai
import pytest

from .conftest import (
    Stack,
    engine_pid,
    launch_stack,
    pid_gone,
    wait_for,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(
        tmp_path_factory.mktemp("window"),
        node_name="window-node",
        server_env={
            "HETEROFLOW_LEADER_RENEW_INTERVAL_S": "0.5",
            "HETEROFLOW_SCHEDULE_WINDOW_INTERVAL_S": "0.5",
        },
    ) as st:
        yield st


def _hhmm(t: datetime) -> str:
    return t.strftime("%H:%M")


def _chat(client: openai.OpenAI, model: str) -> bool:
    try:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0,
        )
    except openai.APIStatusError:
        return False  # the gateway's snapshot has not caught up yet
    return bool(out.choices[0].message.content)


def _window_events(st: Stack, group_id: str) -> list[dict[str, Any]]:
    events = st.api("GET", f"/api/v1/task-groups/{group_id}/events").json()
    return [e for e in events if e["kind"].startswith("window.")]


@pytest.mark.feature("K1", "E2")
def test_a_window_outside_now_pauses_the_service_and_moving_it_over_now_resumes_it(
    stack: Stack,
) -> None:
    g = stack.create_service("nightly")
    running = stack.wait_status(g["id"], "running", 60)
    port = int(running["tasks"][0]["ports"][0]["host_port"])
    pid = wait_for(lambda: engine_pid(port), 10, "the engine process")
    client = openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=g["api_key"], max_retries=0, timeout=60
    )
    path = f"/api/v1/task-groups/{g['id']}/schedule-window"
    try:
        wait_for(lambda: _chat(client, "nightly-model"), 15, "an answer through the gateway")

        # a window two hours from now: the service is outside it
        now = datetime.now(UTC)
        body = {"timezone": "UTC", "start": _hhmm(now + timedelta(hours=2)),
                "end": _hhmm(now + timedelta(hours=3)), "action": "pause"}
        r = stack.api("PUT", path, json=body)
        assert r.status_code == 200, r.text
        assert r.json()["inside"] is False
        start = time.monotonic()
        paused = stack.wait_status(g["id"], "sleeping", 20)
        wait_for(lambda: engine_pid(port) is None, 15, "the engine process gone", 0.05)
        paused_s = time.monotonic() - start
        assert pid_gone(pid)
        assert (paused["window_action"], paused["window_saved_replicas"]) == ("pause", 1)
        [event] = _window_events(stack, g["id"])
        assert event["kind"] == "window.pause" and "paused: 1 task(s) put to sleep" in (
            event["message"]
        )
        time.sleep(1.5)  # rounds go on: nothing more happens while it is outside
        assert len(_window_events(stack, g["id"])) == 1
        assert engine_pid(port) is None

        # the window moved over now: the next round wakes it (no request is sent meanwhile)
        now = datetime.now(UTC)
        body = {**body, "start": _hhmm(now - timedelta(hours=1)),
                "end": _hhmm(now + timedelta(hours=1))}
        r = stack.api("PUT", path, json=body)
        assert r.status_code == 200 and r.json()["inside"] is True, r.text
        start = time.monotonic()
        resumed = stack.wait_status(g["id"], "running", 60)
        resumed_s = time.monotonic() - start
        assert resumed["window_action"] == ""
        assert engine_pid(port) not in (None, pid)
        events = _window_events(stack, g["id"])
        assert [e["kind"] for e in events] == ["window.pause", "window.resume"]
        assert "the window opened: resumed: 1 task(s) woken" in events[-1]["message"]
        # and it answers through the OpenAI SDK again
        wait_for(lambda: _chat(client, "nightly-model"), 15, "an answer after the resume")
    finally:
        client.close()
    print(
        f"\nschedule window: paused (asleep, engine gone) {paused_s:.2f} s after the window "
        f"was set outside now; running again {resumed_s:.2f} s after it was moved over now"
    )
