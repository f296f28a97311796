"""The OpenAI Python SDK against the gateway in front of a real llama.cpp engine.

What a developer does with the SDK — sync and async calls, streams, tools, embeddings,
the model list, errors caught by class, the request id, the Responses API — must work
whichever engine serves the model (issue 15's proof with the real client).
"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from tests.clients.conftest import (
    EMPTY_MODEL,
    KEY,
    MODEL,
    OVERLONG_PROMPT,
    TOOL_MESSAGES,
    WEATHER_TOOL,
    Stack,
)

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
TOOLS: list[ChatCompletionToolParam] = [WEATHER_TOOL]  # type: ignore[list-item]
TOOL_MSG: list[ChatCompletionMessageParam] = TOOL_MESSAGES  # type: ignore[assignment]


@pytest.mark.feature("M1")
def test_sync_chat_completion(gw: Stack) -> None:
    resp = gw.openai().chat.completions.create(
        model=MODEL, messages=MSG, max_tokens=8, temperature=0
    )
    choice = resp.choices[0]
    assert isinstance(choice.message.content, str) and len(choice.message.content) == 8
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 8
    assert resp.id.startswith("chatcmpl-")
    assert resp.object == "chat.completion"


@pytest.mark.feature("M1")
def test_async_client_two_requests_at_once(gw: Stack) -> None:
    async def main() -> list[str | None]:
        async with openai.AsyncOpenAI(
            base_url=gw.url, api_key=KEY, max_retries=0, timeout=60.0
        ) as client:
            answers = await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=MODEL, messages=MSG, max_tokens=8, temperature=0
                    )
                    for _ in range(2)
                )
            )
        return [a.choices[0].message.content for a in answers]

    first, second = asyncio.run(main())
    assert first == second and first is not None and len(first) == 8


@pytest.mark.feature("M1")
def test_stream_ends_with_a_usage_chunk_when_asked(gw: Stack) -> None:
    client = gw.openai()
    whole = client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MSG,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    # OpenAI's placement: content chunks without usage, then one chunk with usage and
    # no choices at all.
    *content, last = chunks
    assert all(c.usage is None for c in content)
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens == 8
    finishes = [c.choices[0].finish_reason for c in content if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")


@pytest.mark.feature("M1")
def test_stream_without_include_usage_has_no_usage(gw: Stack) -> None:
    chunks = list(
        gw.openai().chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=4, temperature=0, stream=True
        )
    )
    assert chunks and all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.feature("M13")
def test_tool_choice_required_returns_a_tool_call(gw: Stack) -> None:
    resp = gw.openai().chat.completions.create(
        model=MODEL,
        messages=TOOL_MSG,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
    )
    message = resp.choices[0].message
    assert message.tool_calls, f"no tool call: {message!r} (jinja={gw.jinja})"
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


@pytest.mark.feature("M13")
def test_tool_call_streams_as_deltas(gw: Stack) -> None:
    stream = gw.openai().chat.completions.create(
        model=MODEL,
        messages=TOOL_MSG,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                if delta.function and delta.function.name:
                    names[delta.index] = delta.function.name
                if delta.function and delta.function.arguments:
                    so_far = arguments.get(delta.index, "")
                    arguments[delta.index] = so_far + delta.function.arguments
    assert names and set(names.values()) == {"get_weather"}, f"jinja={gw.jinja}"
    assert json.loads(arguments[0])["city"] in ("Paris", "Rome")


@pytest.mark.feature("M1")
def test_embeddings_float_and_base64(gw: Stack) -> None:
    client = gw.openai()
    floats = client.embeddings.create(
        model=MODEL, input=["alpha", "beta"], encoding_format="float"
    )
    assert [d.index for d in floats.data] == [0, 1]
    assert {len(d.embedding) for d in floats.data} == {64}
    assert floats.data[0].embedding != floats.data[1].embedding
    # Without encoding_format the SDK asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model=MODEL, input=["alpha", "beta"])
    for a, b in zip(decoded.data, floats.data, strict=True):
        assert a.embedding == pytest.approx(b.embedding, rel=1e-5, abs=1e-6)
    assert floats.usage.prompt_tokens > 0


@pytest.mark.feature("M13")
def test_embeddings_dimensions_are_honoured_or_refused(gw: Stack) -> None:
    client = gw.openai()
    try:
        resp = client.embeddings.create(
            model=MODEL, input="alpha", dimensions=16, encoding_format="float"
        )
    except openai.BadRequestError as exc:
        assert exc.param == "dimensions"
    else:
        assert len(resp.data[0].embedding) == 16


@pytest.mark.feature("M1")
def test_models_list_and_retrieve(gw: Stack) -> None:
    client = gw.openai()
    models = list(client.models.list())
    assert [m.id for m in models] == [MODEL, EMPTY_MODEL, "auto"]  # "auto": M10, last
    assert all(m.created > 0 for m in models)  # a real time, not 1970 (issue 15)
    one = client.models.retrieve(MODEL)
    assert one.id == MODEL and one.object == "model"
    assert one.created > 0


@pytest.mark.feature("M12")
def test_wrong_key_is_authentication_error(gw: Stack) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        gw.openai("sk-not-a-key").chat.completions.create(model=MODEL, messages=MSG)
    assert info.value.status_code == 401
    assert info.value.code == "invalid_api_key"


@pytest.mark.feature("M12")
def test_unknown_model_is_not_found_error(gw: Stack) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        gw.openai().chat.completions.create(model="no-such-model", messages=MSG)
    assert info.value.code == "model_not_found"
    assert info.value.type == "invalid_request_error"


@pytest.mark.feature("M12")
@pytest.mark.feature("M13")
def test_temperature_out_of_range_is_bad_request_naming_the_param(gw: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().chat.completions.create(
            model=MODEL, messages=MSG, max_tokens=4, temperature=5
        )
    assert info.value.param == "temperature"
    assert info.value.type == "invalid_request_error"
    assert isinstance(info.value.code, str | None)


@pytest.mark.feature("M12")
@pytest.mark.feature("M13")
def test_overlong_prompt_is_context_length_exceeded(gw: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        gw.openai().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": OVERLONG_PROMPT}], max_tokens=4
        )
    assert info.value.status_code == 400
    assert info.value.code == "context_length_exceeded"
    assert info.value.type == "invalid_request_error"
    assert info.value.param == "messages"


@pytest.mark.feature("M12")
def test_route_without_backend_is_internal_server_error(gw: Stack) -> None:
    with pytest.raises(openai.InternalServerError) as info:
        gw.openai().chat.completions.create(model=EMPTY_MODEL, messages=MSG)
    assert info.value.status_code == 503
    assert info.value.code == "no_healthy_backend"


@pytest.mark.feature("M13")
def test_raw_response_carries_the_request_id(gw: Stack) -> None:
    client = gw.openai()
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=2
    )
    request_id = raw.headers.get("x-request-id")
    assert request_id
    assert raw.parse()._request_id == request_id
    # The caller's own id is kept.
    mine = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=MSG, max_tokens=2, extra_headers={"X-Request-Id": "req-mine-1"}
    )
    assert mine.headers.get("x-request-id") == "req-mine-1"
    # Errors carry one too: that is when a developer needs it.
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=MSG)
    assert info.value.request_id


@pytest.mark.feature("M14")
def test_responses_create(gw: Stack) -> None:
    resp = gw.openai().responses.create(model=MODEL, input="Hello", max_output_tokens=8)
    assert resp.id.startswith("resp_")
    assert resp.object == "response"
    assert len(resp.output_text) == 8
    assert resp.usage is not None and resp.usage.output_tokens == 8
    assert resp.status in ("completed", "incomplete")
