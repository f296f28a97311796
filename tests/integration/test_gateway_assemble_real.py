"""Non-stream answers through the gateway from a real llama.cpp engine (issue 15, item 6).

The gateway sends a client's non-stream chat and completions requests to llama.cpp as
streams (so that a client that leaves stops the generation: test_gateway_soak_real.py)
and assembles the JSON answer (``gateway.assemble``). What the client gets must be what
the engine answers the same request directly, non-streamed, at temperature 0: the same
texts, tool calls, finish reasons, logprob tokens and token counts, with ``n`` > 1 too —
in OpenAI's schema. Usage accounting and idempotency replays work on it as on any answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from heteroflow.core.clock import SystemClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.policy.usage import UsageCollector
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.usage import UsageRow
from heteroflow.testing.fake_openai_backend import UvicornThread
from tests.clients.conftest import TOOL_MESSAGES, WEATHER_TOOL
from tests.gateway_stack import serve_gateway, snapshot, start_engine, target
from tests.openai_schema import conforms

KEY = "sk-assemble-real-0001"
MODEL = "tiny-chat"
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "Tell me"}], "temperature": 0}
PROMPT: dict[str, Any] = {"prompt": "Once upon", "temperature": 0}


class ListSink:
    def __init__(self) -> None:
        self.rows: list[UsageRow] = []

    async def write(self, rows: Sequence[UsageRow]) -> None:
        self.rows += rows


@dataclass
class Env:
    app: GatewayApp
    url: str  # the engine's
    engine: httpx.Client
    gateway: httpx.Client
    sink: ListSink
    thread: UvicornThread
    usage: UsageCollector


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    model = write_tiny_gguf(tmp_path_factory.mktemp("models") / "tools.gguf", tools=True)
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    sink = ListSink()
    usage = UsageCollector(sink, SystemClock(), interval_s=3600)
    headers = {"Authorization": f"Bearer {KEY}"}
    with (
        start_engine(model, log, "--jinja") as engine,
        serve_gateway(
            snapshot({MODEL: target("tiny", engine.url, algorithm="least_connections")}, key=KEY),
            usage=usage,
        ) as gw,
        httpx.Client(base_url=engine.url, timeout=60) as direct,
        httpx.Client(base_url=gw.url, headers=headers, timeout=60) as through,
    ):
        yield Env(gw.app, engine.url, direct, through, sink, gw.thread, usage)


def _both(env: Env, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The engine's own non-stream answer, and the gateway's (conforming) one."""
    direct = env.engine.post(path, json=body)
    assert direct.status_code == 200, direct.text
    through = env.gateway.post(f"/v1{path.removeprefix('/v1')}", json={**body, "model": MODEL})
    assert through.status_code == 200, through.text
    assert through.headers["content-type"].startswith("application/json")
    answer: dict[str, Any] = through.json()
    conforms(answer)
    return direct.json(), answer


def _counts(answer: dict[str, Any]) -> tuple[int, int]:
    return answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"]


def _chat_view(choice: dict[str, Any]) -> tuple[Any, ...]:
    msg = choice["message"]
    return choice["index"], msg["role"], msg["content"], choice["finish_reason"]


@pytest.mark.feature("M13")
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stop", [False, True])  # cut by length; by a stop string
def test_a_chat_answer_is_the_engines_own_non_stream_answer(env: Env, n: int, stop: bool) -> None:
    body = {**CHAT, "n": n, "max_tokens": 12}
    if stop:  # two characters from the middle of what the model writes
        text = env.engine.post("/v1/chat/completions", json=body).json()["choices"][0]
        body["stop"] = [text["message"]["content"][5:7]]
    direct, answer = _both(env, "/v1/chat/completions", body)
    assert direct["choices"][0]["finish_reason"] == ("stop" if stop else "length")
    assert [_chat_view(c) for c in answer["choices"]] == [_chat_view(c) for c in direct["choices"]]
    assert len(answer["choices"]) == n
    assert _counts(answer) == _counts(direct)
    assert answer["object"] == "chat.completion"
    assert answer["system_fingerprint"] == direct["system_fingerprint"]
    assert env.app._upstream.assembles(env.url)  # the gateway asked the engine for a stream


@pytest.mark.feature("M13")
@pytest.mark.parametrize("n", [1, 2])
def test_a_completion_is_the_engines_own_non_stream_answer(env: Env, n: int) -> None:
    direct, answer = _both(env, "/v1/completions", {**PROMPT, "n": n, "max_tokens": 12})
    view = [(c["index"], c["text"], c["finish_reason"]) for c in answer["choices"]]
    assert view == [(c["index"], c["text"], c["finish_reason"]) for c in direct["choices"]]
    assert len(view) == n
    assert _counts(answer) == _counts(direct)
    # and a list of prompts (one choice each)
    prompts = {**PROMPT, "prompt": ["Hi", "Yo"], "max_tokens": 5}
    direct, answer = _both(env, "/v1/completions", prompts)
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in direct["choices"]]


@pytest.mark.feature("M13")
def test_logprobs_come_token_by_token_as_the_engine_gives_them(env: Env) -> None:
    body = {**CHAT, "max_tokens": 6, "logprobs": True, "top_logprobs": 2}
    direct, answer = _both(env, "/v1/chat/completions", body)
    tokens = [t["token"] for t in answer["choices"][0]["logprobs"]["content"]]
    assert tokens == [t["token"] for t in direct["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 6
    assert all(len(t["top_logprobs"]) == 2 for t in answer["choices"][0]["logprobs"]["content"])
    # completions: in that API's legacy shape (normalize), the same tokens
    direct, answer = _both(env, "/v1/completions", {**PROMPT, "max_tokens": 6, "logprobs": 2})
    legacy = answer["choices"][0]["logprobs"]
    assert legacy["tokens"] == [t["token"] for t in direct["choices"][0]["logprobs"]["content"]]
    assert legacy["text_offset"][0] == 0 and len(legacy["top_logprobs"]) == 6


@pytest.mark.feature("M13")
def test_a_tool_call_is_assembled_as_the_engine_parses_it(env: Env) -> None:
    body = {"messages": TOOL_MESSAGES, "tools": [WEATHER_TOOL], "tool_choice": "required",
            "temperature": 0, "max_tokens": 60}  # fmt: skip
    direct, answer = _both(env, "/v1/chat/completions", body)

    def calls(a: dict[str, Any]) -> list[tuple[str, str, str]]:
        tcs = a["choices"][0]["message"]["tool_calls"]
        return [(t["type"], t["function"]["name"], t["function"]["arguments"]) for t in tcs]

    assert calls(answer) == calls(direct)
    assert calls(answer)[0][1] == "get_weather"
    assert answer["choices"][0]["message"]["tool_calls"][0]["id"]
    assert answer["choices"][0]["finish_reason"] == direct["choices"][0]["finish_reason"]


@pytest.mark.feature("M13")
def test_engine_errors_and_replays_and_usage_work_on_assembled_answers(env: Env) -> None:
    # the engine refuses the streamed request before it streams: its 400, normalised
    overlong = {**PROMPT, "model": MODEL, "prompt": "word " * 3000, "max_tokens": 3}
    r = env.gateway.post("/v1/completions", json=overlong)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    # idempotency (M9): the assembled answer is recorded and replayed byte for byte
    body = {**CHAT, "model": MODEL, "max_tokens": 7, "user": "replay"}
    headers = {"Idempotency-Key": "assemble-replay-1"}
    first = env.gateway.post("/v1/chat/completions", json=body, headers=headers)
    again = env.gateway.post("/v1/chat/completions", json=body, headers=headers)
    assert first.status_code == again.status_code == 200
    assert again.content == first.content
    # usage (M7): the request's tokens are counted from the assembled answer
    env.thread.call(env.usage.flush())
    before = sum(r.completion_tokens for r in env.sink.rows)
    r = env.gateway.post("/v1/chat/completions", json={**body, "max_tokens": 9})
    assert r.json()["usage"]["completion_tokens"] == 9
    env.thread.call(env.usage.flush())
    assert sum(r.completion_tokens for r in env.sink.rows) - before == 9
