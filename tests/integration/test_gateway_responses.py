"""/v1/responses end to end (M14): the real openai SDK's ``client.responses`` against the
real gateway on uvicorn, in front of the real llama.cpp launcher on the tiny model (text,
streams) and the fake engine (tool calls: the tiny model makes none of its own)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.responses import FunctionToolParam, Response

from heteroflow.gateway.app import GatewayApp
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from tests.gateway_stack import Engine, serve_gateway, snapshot, start_engine, target

KEY = "sk-test-responses-key-0001"
TINY, FAKE = "tiny", "fake"
WEATHER: FunctionToolParam = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}
_ids = itertools.count()


@dataclass
class Env:
    gateway: GatewayApp
    url: str
    engine: Engine
    fake: FakeOpenAIBackend

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=KEY, max_retries=0, timeout=30.0)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("responses")
    with start_engine(write_tiny_gguf(tmp / "tiny.gguf"), tmp / "engine.log") as engine:
        thread = UvicornThread()
        fake = FakeOpenAIBackend(["engine-fake"], name="fake")
        fake_url = f"http://127.0.0.1:{thread.serve(fake)}"
        routes = {TINY: target("tiny", engine.url), FAKE: target("fake", fake_url)}
        try:
            with serve_gateway(snapshot(routes, key=KEY, tenant="tenant-1"), thread) as gw:
                yield Env(gw.app, f"{gw.url}/v1", engine, fake)
        finally:
            thread.stop()


def _chat_text(client: openai.OpenAI) -> str:
    """What the same prompt gives on chat completions (temperature 0: deterministic)."""
    chat = client.chat.completions.create(
        model=TINY,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        max_tokens=8,
        temperature=0,
    )
    content = chat.choices[0].message.content
    assert content
    return content


@pytest.mark.feature("M14")
def test_responses_create_answers_text_from_llamacpp(env: Env) -> None:
    client = env.client()
    resp = client.responses.create(
        model=TINY, instructions="Be brief.", input="Hello", max_output_tokens=8, temperature=0
    )
    assert resp.id.startswith("resp_") and resp.model == TINY
    assert resp.output_text == _chat_text(client)  # the same generation, retold
    # the tiny model never stops by itself: the limit ends it, as OpenAI says it
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 8
    assert resp.usage.total_tokens == resp.usage.input_tokens + 8
    assert resp.instructions == "Be brief." and resp.max_output_tokens == 8


@pytest.mark.feature("M14")
def test_responses_stream_from_llamacpp_in_openais_event_order(env: Env) -> None:
    client = env.client()
    expected = _chat_text(client)
    with client.responses.create(
        model=TINY,
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello"}]}],
        max_output_tokens=8,
        temperature=0,
        stream=True,
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # max_output_tokens reached
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == expected
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.output_text == expected
    # the usage the engine reported for the stream, always asked for upstream
    assert last.response.usage is not None and last.response.usage.output_tokens == 8


@pytest.mark.feature("M14")
def test_a_completed_stream_ends_with_response_completed_and_usage(env: Env) -> None:
    with env.client().responses.create(
        model=FAKE, input="hi", stream=True, extra_body={"fake_prompt_tokens": 4}
    ) as stream:
        events = list(stream)
    last = events[-1]
    assert last.type == "response.completed"
    assert last.response.status == "completed" and last.response.output_text == "tok tok tok"
    assert last.response.usage is not None
    assert (last.response.usage.input_tokens, last.response.usage.output_tokens) == (4, 3)


def test_the_sdks_stream_helper_assembles_the_final_response(env: Env) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    with env.client().responses.stream(
        model=FAKE, input="hi", tools=[WEATHER], extra_body={"fake_tool_call": call}
    ) as stream:
        final = stream.get_final_response()
    item = final.output[0]
    assert item.type == "function_call" and item.arguments == '{"city": "Oslo"}'


@pytest.mark.feature("M14")
def test_a_tool_call_becomes_a_function_call_item(env: Env) -> None:
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    resp = env.client().responses.create(
        model=FAKE, input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
        extra_body={"fake_tool_call": call},
    )
    item = resp.output[0]
    assert item.type == "function_call"
    assert (item.name, item.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert item.call_id.startswith("call-") and item.id is not None and item.id.startswith("fc_")
    # what reached the engine: chat tools, nested as chat completions has them
    sent = env.fake.received[-1]
    assert sent[0] == "/v1/chat/completions"
    assert b'"tools":[{"type":"function","function":{"name":"get_weather"' in sent[1]
    assert b'"tool_choice":"required"' in sent[1]


@pytest.mark.feature("M14")
def test_a_streamed_tool_call_and_its_result_in_the_next_turn(env: Env) -> None:
    client = env.client()
    call = {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    with client.responses.create(
        model=FAKE, input="Weather in Oslo?", tools=[WEATHER], stream=True,
        extra_body={"fake_tool_call": call},
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[2:] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    last = events[-1]
    assert last.type == "response.completed"
    item = last.response.output[0]
    assert item.type == "function_call" and item.arguments == '{"city": "Oslo"}'
    # the next turn sends the call and its output back, as the SDK's examples do
    follow_up: list[Any] = [
        {"role": "user", "content": "Weather in Oslo?"},
        item.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": item.call_id, "output": "rain"},
    ]
    resp = client.responses.create(model=FAKE, input=follow_up, tools=[WEATHER])
    assert resp.output_text == "tok tok tok"
    messages = orjson.loads(env.fake.received[-1][1])["messages"]
    assert messages[1]["tool_calls"][0]["id"] == item.call_id
    assert messages[2] == {"role": "tool", "tool_call_id": item.call_id, "content": "rain"}


@pytest.mark.feature("M14")
def test_what_needs_stored_state_is_refused_with_the_param(env: Env) -> None:
    client = env.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=TINY, input="again", previous_response_id="resp_123")
    assert caught.value.param == "previous_response_id"
    assert "stores no responses" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=TINY, input="hi", tools=[{"type": "web_search"}])
    assert caught.value.param == "tools[0].type"


@pytest.mark.feature("M14")
def test_an_idempotent_replay_returns_the_same_response(env: Env) -> None:
    client = env.client()
    key = {"Idempotency-Key": f"responses-{next(_ids)}"}
    first = client.responses.with_raw_response.create(model=FAKE, input="hi", extra_headers=key)
    again = client.responses.with_raw_response.create(model=FAKE, input="hi", extra_headers=key)
    assert again.headers.get("idempotent-replayed") == "true"
    assert again.parse().id == first.parse().id
    assert Response.model_validate_json(again.content).output_text == "tok tok tok"


def test_responses_requests_are_counted_under_their_own_path(env: Env) -> None:
    env.client().responses.create(model=FAKE, input="hi")
    text = env.gateway.metrics.render().decode()
    assert 'path="/v1/responses",model="fake",status="200"' in text
    # no stored responses to fetch
    got = httpx.get(f"{env.url}/responses/resp_1", headers={"Authorization": f"Bearer {KEY}"})
    assert got.status_code == 404
