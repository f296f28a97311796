"""Idle sleep and wake on request end to end (F4, F6): real ``heteroflow server``,
``heteroflow agent`` (process runtime, the real llama.cpp engine on a tiny model) and a
separate ``heteroflow gateway``; requests through the OpenAI SDK.

One "minute" of ``idle_timeout_minutes`` is 1 s here (``HETEROFLOW_IDLE_MINUTE_S``), so
a 3-minute timeout is 3 s, and the gateways flush every 0.3 s instead of 5 s. Proven:
requests through the separate gateway keep a service awake (its activity reaches the
server over HTTP); without them it is put to sleep and its engine process is gone; a
chat request through the separate gateway — and a stream through the server's own
gateway — wakes it, is held while the engine starts, and gets its answer. The figures
are printed (``-s``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
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

TIMEOUT_MINUTES = 3  # x 1 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(
        tmp_path_factory.mktemp("idle"),
        node_name="idle-node",
        server_env={
            "HETEROFLOW_IDLE_MINUTE_S": "1",
            "HETEROFLOW_IDLE_CHECK_INTERVAL_S": "0.25",
            "HETEROFLOW_LEADER_RENEW_INTERVAL_S": "0.5",
            # busy groups' times are flushed every interval (the first request after a
            # quiet spell at once); one interval must be well inside the (scaled) timeout
            "HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "0.3",
        },
        gateway_env={"HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "0.3"},
    ) as st:
        yield st


def _chat(client: openai.OpenAI, model: str) -> str:
    out = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    return str(out.choices[0].message.content)


def _answers(client: openai.OpenAI, model: str) -> bool:
    """True once the gateway routes to the service (its snapshot caught up)."""
    try:
        return bool(_chat(client, model))
    except openai.APIStatusError:
        return False


def _asleep_and_gone(st: Stack, group_id: str, port: int, timeout_s: float) -> float:
    """Waits for the idle timer: the service sleeping and its engine process gone."""
    start = time.monotonic()
    st.wait_status(group_id, "sleeping", timeout_s)
    wait_for(lambda: engine_pid(port) is None, 10, "the engine process gone", 0.05)
    took = time.monotonic() - start
    # the gateways' snapshots follow within a poll (1 s): a request sent in that window
    # still meets the stopped engine (502, which the SDKs retry) — not what is tested here
    time.sleep(1.5)
    return took


@pytest.mark.feature("F4", "F6")
def test_idle_service_sleeps_and_a_chat_request_wakes_it(stack: Stack) -> None:
    g = stack.create_service("idler", idle_timeout_minutes=TIMEOUT_MINUTES)
    running = stack.wait_status(g["id"], "running", 60)
    port = int(running["tasks"][0]["ports"][0]["host_port"])
    pid = wait_for(lambda: engine_pid(port), 10, "the engine process")
    via_gateway = openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=g["api_key"], max_retries=0, timeout=60
    )
    via_server = openai.OpenAI(
        base_url=stack.server_url + "/v1", api_key=g["api_key"], max_retries=0, timeout=60
    )
    try:
        wait_for(lambda: _answers(via_gateway, "idler-model"), 10, "the gateway routes to it")
        # traffic through the separate gateway keeps it awake past its timeout
        busy_until = time.monotonic() + 2 * TIMEOUT_MINUTES
        while time.monotonic() < busy_until:
            assert _chat(via_gateway, "idler-model")
            time.sleep(0.5)
        assert stack.group(g["id"])["status"] == "running"
        assert engine_pid(port) == pid

        # quiet: asleep after its timeout, the engine process gone
        slept_s = _asleep_and_gone(stack, g["id"], port, 3 * TIMEOUT_MINUTES + 10)
        assert pid_gone(pid)
        events = stack.api("GET", f"/api/v1/task-groups/{g['id']}/events").json()
        assert any(f"idle for {TIMEOUT_MINUTES} min" in e["message"] for e in events), events
        # listed while asleep
        assert [m.id for m in via_gateway.models.list()] == ["idler-model"]

        # a chat request through the separate gateway wakes it and gets its answer
        start = time.monotonic()
        assert _chat(via_gateway, "idler-model")
        woke_gateway_s = time.monotonic() - start
        assert stack.group(g["id"])["status"] == "running"
        assert engine_pid(port) not in (None, pid)

        # again through the server's own gateway
        _asleep_and_gone(stack, g["id"], port, 3 * TIMEOUT_MINUTES + 10)
        start = time.monotonic()
        stream = via_server.chat.completions.create(
            model="idler-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
        )
        first_chunk_s = None
        chunks = []
        for chunk in stream:
            if first_chunk_s is None:
                first_chunk_s = time.monotonic() - start
            chunks.append(chunk)
        assert chunks and first_chunk_s is not None
        assert stack.group(g["id"])["status"] == "running"

        metrics = httpx.get(stack.gateway_url + "/metrics").text
        assert 'heteroflow_gateway_wake_holds_total{model="idler-model",outcome="ready"} 1' in (
            metrics
        )
    finally:
        via_gateway.close()
        via_server.close()
    print(
        f"\nidle timeout {TIMEOUT_MINUTES} s: asleep and engine gone {slept_s:.2f} s after "
        f"the last request; wake on request: answer via the separate gateway "
        f"{woke_gateway_s:.2f} s, first stream chunk via the server {first_chunk_s:.2f} s"
    )


def test_the_group_reports_its_last_request(stack: Stack) -> None:
    g: dict[str, Any] = stack.create_service("reporter")
    stack.wait_status(g["id"], "running", 60)
    client = openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=g["api_key"], max_retries=0, timeout=30
    )
    try:
        wait_for(lambda: _answers(client, "reporter-model"), 10, "an answer")
    finally:
        client.close()
    # the first request after a quiet spell is flushed at once, not at the next interval
    wait_for(
        lambda: stack.group(g["id"]).get("last_request_at"), 3, "last_request_at reported", 0.1
    )
