"""M17 end to end: real ``heteroflow server``, ``heteroflow agent`` (process runtime, the
real llama.cpp engine on a tiny model) and a separate ``heteroflow gateway``; clients are
the OpenAI SDK with its retries off, so a 503 would fail the test.

A service is created while its node's agent is paused (SIGSTOP: its replica stays
scheduled, nothing can start it), so the requests certainly arrive while the replica is
on its way up. A chat request through the separate gateway and a stream through the
server's own gateway are held, not refused with 503 "No healthy backend"; the agent goes
on, the engine loads, and both are answered. The figures are printed (``-s``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from .conftest import Stack, launch_stack, wait_for

pytestmark = pytest.mark.e2e

MSG: list[Any] = [{"role": "user", "content": "hi"}]
PAUSE_S = 2.0  # well inside node_offline_after_s (20 s)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with launch_stack(tmp_path_factory.mktemp("start-hold"), node_name="start-node") as st:
        yield st


def _listed(url: str, key: str, model: str) -> bool:
    r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
    return r.status_code == 200 and model in [m["id"] for m in r.json()["data"]]


def _chat(client: openai.OpenAI, model: str) -> tuple[str, float]:
    start = time.monotonic()
    out = client.chat.completions.create(model=model, messages=MSG, max_tokens=4, temperature=0)
    return str(out.choices[0].message.content), time.monotonic() - start


def _stream(client: openai.OpenAI, model: str) -> tuple[int, float]:
    start = time.monotonic()
    chunks = list(
        client.chat.completions.create(model=model, messages=MSG, max_tokens=4, stream=True)
    )
    return len(chunks), time.monotonic() - start


@pytest.mark.feature("M17")
def test_requests_sent_while_the_replica_starts_are_answered_once_it_is_up(
    stack: Stack,
) -> None:
    agent = next(p for p in stack.procs if p.name == "agent").popen
    model = "starter-model"
    agent.send_signal(signal.SIGSTOP)
    try:
        g = stack.create_service("starter")
        key = g["api_key"]
        # both gateways know the route (its replica on its way up), not yet a backend
        wait_for(lambda: _listed(stack.gateway_url, key, model), 10, "listed by the gateway", 0.05)
        wait_for(lambda: _listed(stack.server_url, key, model), 10, "listed by the server", 0.05)
        assert stack.group(g["id"])["status"] != "running"
        via_gateway = openai.OpenAI(
            base_url=stack.gateway_url + "/v1", api_key=key, max_retries=0, timeout=60
        )
        via_server = openai.OpenAI(
            base_url=stack.server_url + "/v1", api_key=key, max_retries=0, timeout=60
        )
        pool = ThreadPoolExecutor(2)
        chat = pool.submit(_chat, via_gateway, model)
        stream = pool.submit(_stream, via_server, model)
        time.sleep(PAUSE_S)
        assert not chat.done() and not stream.done()  # held, not refused
    finally:
        agent.send_signal(signal.SIGCONT)
    try:
        content, chat_s = chat.result(60)
        chunks, stream_s = stream.result(60)
    finally:
        pool.shutdown()
        via_gateway.close()
        via_server.close()
    assert content and chunks
    assert stack.group(g["id"])["status"] == "running"
    for url in (stack.gateway_url, stack.server_url):
        metrics = httpx.get(url + "/metrics").text
        assert f'heteroflow_gateway_start_holds_total{{model="{model}",outcome="ready"}} 1' in (
            metrics
        ), url
    print(
        f"\nheld while the replica started ({PAUSE_S:.0f} s of it with the agent paused): "
        f"chat via the separate gateway answered after {chat_s:.2f} s, "
        f"stream via the server's gateway after {stream_s:.2f} s"
    )
