"""Requests checked at the gateway, seen from the real openai SDK: a body that breaks
OpenAI's request shape is a ``BadRequestError`` naming the field, and the engine behind
the route never receives it; a good body with engine parameters reaches the engine as sent.

Real uvicorn servers (gateway and a fake engine) on one background loop, as in
test_gateway_sdk.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest

from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from tests.gateway_stack import serve_gateway, snapshot

KEY = "sk-test-request-checks-0001"
TENANT = "tenant-1"
MODELS = ("chat-model", "text-model", "embed-model")
USER: Any = [{"role": "user", "content": "hi"}]


@dataclass
class Env:
    engine: FakeOpenAIBackend
    port: int
    client: openai.OpenAI

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    engine = FakeOpenAIBackend(["engine-model"], name="e")
    url = f"http://127.0.0.1:{thread.serve(engine)}"
    routing = snapshot({m: (url,) for m in MODELS}, key=KEY, tenant=TENANT)
    try:
        with (
            serve_gateway(routing, thread) as gw,
            # max_retries=2: a 400 must not be retried (a 5xx would be, and would reach the engine)
            openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=2) as client,
        ):
            yield Env(engine, gw.port, client)
    finally:
        thread.stop()


def _refused(env: Env, call: Any) -> openai.BadRequestError:
    before = len(env.engine.received)
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert len(env.engine.received) == before, "the engine must never see a refused request"
    assert info.value.status_code == 400
    assert info.value.type == "invalid_request_error"
    return info.value


@pytest.mark.feature("M13")
def test_a_temperature_out_of_range_is_refused_before_the_engine(env: Env) -> None:
    err = _refused(
        env, lambda: env.client.chat.completions.create(
            model="chat-model", messages=USER, temperature=3
        )
    )
    assert err.param == "temperature"
    assert err.code == "decimal_above_max_value"
    assert "Expected a value <= 2, but got 3 instead." in err.message


@pytest.mark.feature("M13")
@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": USER, "temperature": True}, "temperature"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": USER, "tools": [{"type": "retrieval"}]}, "tools[0].type"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 25}, "top_logprobs"),
    ],
)
def test_chat_mistakes_name_the_field(env: Env, kwargs: dict[str, Any], param: str) -> None:
    err = _refused(env, lambda: env.client.chat.completions.create(model="chat-model", **kwargs))
    assert err.param == param


@pytest.mark.feature("M13")
def test_completions_and_embeddings_mistakes_name_the_field(env: Env) -> None:
    err = _refused(
        env, lambda: env.client.completions.create(model="text-model", prompt="x", max_tokens=-1)
    )
    assert err.param == "max_tokens"
    err = _refused(env, lambda: env.client.embeddings.create(model="embed-model", input=[]))
    assert err.param == "input"
    err = _refused(
        env,
        lambda: env.client.embeddings.create(
            model="embed-model", input="x", encoding_format="int8"  # type: ignore[arg-type]
        ),
    )
    assert err.param == "encoding_format"


@pytest.mark.feature("M13")
def test_a_good_body_with_engine_parameters_reaches_the_engine_as_sent(env: Env) -> None:
    extra = {"top_k": 40, "min_p": 0.05, "chat_template_kwargs": {"enable_thinking": False}}
    reply = env.client.chat.completions.create(
        model="chat-model", messages=USER, temperature=0.2, extra_body=extra
    )
    assert reply.choices[0].message.content
    path, raw = env.engine.received[-1]
    sent = orjson.loads(raw)
    assert path == "/v1/chat/completions"
    assert {k: sent[k] for k in extra} == extra


@pytest.mark.feature("M13")
def test_the_check_runs_after_the_key_check(env: Env) -> None:
    # A bad body with a bad key is a 401, not a 400: nothing about the body leaks to a
    # caller who may not call the gateway at all.
    resp = httpx.post(
        f"{env.url}/chat/completions",
        headers={"authorization": "Bearer sk-wrong"},
        json={"model": "chat-model", "messages": []},
        timeout=10.0,
    )
    assert resp.status_code == 401
