"""/v1/responses on chat completions (M14): the request, the answer and the stream translated,
and the ASGI exit that applies them; every answer validated against the openai package's
own Responses types."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from heteroflow.gateway.shaping.responses import from_chat, to_chat
from heteroflow.gateway.shaping.responses_adapter import ResponsesExit
from heteroflow.gateway.shaping.responses_stream import StreamTranslator
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Message

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def chat_of(body: dict[str, Any]) -> dict[str, Any]:
    out = to_chat(body)
    assert not isinstance(out, errors.OpenAIError), out
    return out


def refusal_of(body: dict[str, Any]) -> errors.OpenAIError:
    out = to_chat({"model": "m", "input": "hi", **body})
    assert isinstance(out, errors.OpenAIError), out
    assert out.status == 400 and out.type == "invalid_request_error"
    return out


# -- the request ---------------------------------------------------------------------


@pytest.mark.feature("M14")
def test_a_string_input_with_instructions_and_sampling_becomes_a_chat_request() -> None:
    chat = chat_of(
        {
            "model": "m",
            "input": "Tell me a joke",
            "instructions": "Be brief.",
            "max_output_tokens": 64,
            "temperature": 0.2,
            "top_p": 0.9,
            "user": "u-1",
            "metadata": {"k": "v"},
            "store": True,
            "top_k": 40,  # an engine extra: passed on as on chat completions
        }
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a joke"},
        ],
        "max_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.9,
        "user": "u-1",
        "top_k": 40,
    }


@pytest.mark.feature("M14")
def test_input_items_become_messages_tool_calls_and_tool_results() -> None:
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA==", "detail": "low"}
    chat = chat_of(
        {
            "model": "m",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {
                    "type": "message",
                    "role": "user",
                    "content": [{"type": "input_text", "text": "Weather here?"}, image],
                },
                # a previous response's output, appended as it is
                {
                    "type": "message",
                    "id": "msg_1",
                    "role": "assistant",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "get_weather",
                 "arguments": '{"city":"Oslo"}'},
                {"type": "function_call", "call_id": "c2", "name": "get_weather",
                 "arguments": '{"city":"Bergen"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "rain"},
                {"type": "function_call_output", "call_id": "c2",
                 "output": [{"type": "input_text", "text": "sun"}]},
            ],
        }
    )
    def call(cid: str, city: str) -> dict[str, Any]:
        args = orjson.dumps({"city": city}).decode()
        return {"id": cid, "type": "function",
                "function": {"name": "get_weather", "arguments": args}}

    assert chat["messages"] == [
        {"role": "system", "content": "Use tools."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Weather here?"},
                {"type": "image_url",
                 "image_url": {"url": "data:image/png;base64,AA==", "detail": "low"}},
            ],
        },
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [  # parallel calls: one assistant message
                call("c1", "Oslo"),
                call("c2", "Bergen"),
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "sun"},
    ]


@pytest.mark.feature("M14")
def test_flat_function_tools_tool_choice_format_and_stream_are_translated() -> None:
    chat = chat_of(
        {
            "model": "m",
            "input": "hi",
            "tools": [WEATHER, {**WEATHER, "name": "other"}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"},
                                "strict": True}},
            "reasoning": {"effort": "low"},
            "stream": True,
        }
    )
    assert chat["tools"][0] == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER["parameters"],
            "strict": True,
        },
    }
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
    }
    assert chat["reasoning_effort"] == "low"
    # the usage event is always asked for: response.completed carries the usage
    assert chat["stream"] is True and chat["stream_options"] == {"include_usage": True}


def test_allowed_tools_narrow_the_tools_and_json_object_maps_over() -> None:
    chat = chat_of(
        {
            "model": "m",
            "input": "hi",
            "tools": [WEATHER, {**WEATHER, "name": "other"}],
            "tool_choice": {"type": "allowed_tools", "mode": "required",
                            "tools": [{"type": "function", "name": "other"}]},
            "text": {"format": {"type": "json_object"}},
        }
    )
    assert [t["function"]["name"] for t in chat["tools"]] == ["other"]
    assert chat["tool_choice"] == "required"
    assert chat["response_format"] == {"type": "json_object"}


@pytest.mark.feature("M14")
@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"conversation": "conv_1"}, "conversation", "stores no responses"),
        ({"background": True}, "background", "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt template"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": []}]},
         "tools[1].type", "file_search"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "hosted tools"),
        ({"truncation": "auto"}, "truncation", "context"),
        ({"include": ["message.output_text.logprobs"]}, "include", "logprobs"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "references"),
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0].type",
         "computer_call_output"),
        ({"input": [{"role": "user",
                     "content": [{"type": "input_file", "file_id": "file-1"}]}]},
         "input[0].content[0]", "File inputs"),
        ({"input": [{"role": "user",
                     "content": [{"type": "input_image", "file_id": "file-1", "detail": "auto"}]}]},
         "input[0].content[0].image_url", "files API"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id", "string"),
        ({"max_output_tokens": 0}, "max_output_tokens", "positive"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_param(
    body: dict[str, Any], param: str, words: str
) -> None:
    err = refusal_of(body)
    assert err.param == param
    assert words in err.message


def test_defaults_and_nulls_of_refused_params_pass() -> None:
    chat = chat_of(
        {"model": "m", "input": "hi", "previous_response_id": None, "background": False,
         "truncation": "disabled", "include": ["reasoning.encrypted_content"], "store": False}
    )
    assert chat["messages"] == [{"role": "user", "content": "hi"}]


# -- the answer ----------------------------------------------------------------------

REQUEST = {"model": "route-model", "input": "hi", "instructions": "Be brief.",
           "tools": [WEATHER], "metadata": {"k": "v"}, "temperature": 0.5}
USAGE = {
    "prompt_tokens": 12,
    "completion_tokens": 5,
    "total_tokens": 17,
    "prompt_tokens_details": {"cached_tokens": 8},
}


def chat_answer(message: dict[str, Any], finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "/models/engine-file.gguf",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": USAGE,
    }


@pytest.mark.feature("M14")
def test_a_chat_answer_becomes_a_response_object() -> None:
    out = from_chat(chat_answer({"role": "assistant", "content": "Hello there"}), REQUEST)
    resp = Response.model_validate(out)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.status == "completed" and resp.completed_at is not None
    assert resp.output_text == "Hello there"
    assert resp.output[0].id.startswith("msg_")  # type: ignore[union-attr]
    assert resp.model == "route-model"  # the name the client used, not the engine's file
    assert resp.created_at == 1700000000
    # what OpenAI echoes of the request
    assert resp.instructions == "Be brief." and resp.metadata == {"k": "v"}
    assert resp.temperature == 0.5 and resp.tool_choice == "auto"
    assert resp.tools[0].name == "get_weather"  # type: ignore[union-attr]
    assert resp.parallel_tool_calls is True
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (
        12, 5, 17
    )
    assert resp.usage.input_tokens_details.cached_tokens == 8
    assert resp.usage.output_tokens_details.reasoning_tokens == 0


@pytest.mark.feature("M14")
def test_tool_calls_become_function_call_items() -> None:
    calls = [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}},
    ]
    out = from_chat(
        chat_answer({"role": "assistant", "content": None, "tool_calls": calls}, "tool_calls"),
        REQUEST,
    )
    resp = Response.model_validate(out)
    assert [item.type for item in resp.output] == ["function_call", "function_call"]
    first = resp.output[0]
    assert first.type == "function_call"
    assert first.call_id == "call_a" and first.name == "get_weather"
    assert first.arguments == '{"city":"Oslo"}' and first.id is not None
    assert first.id.startswith("fc_")


def test_the_length_limit_makes_an_incomplete_response() -> None:
    out = from_chat(chat_answer({"role": "assistant", "content": "Hel"}, "length"), REQUEST)
    resp = Response.model_validate(out)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert resp.output_text == "Hel"


def test_text_and_a_refusal_become_message_content_parts() -> None:
    text = from_chat(chat_answer({"role": "assistant", "content": "ok", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}),
        REQUEST)
    assert [i["type"] for i in text["output"]] == ["message", "function_call"]
    refusal = from_chat(chat_answer({"role": "assistant", "content": None, "refusal": "No."}),
                        REQUEST)
    item = Response.model_validate(refusal).output[0]
    assert item.type == "message" and item.content[0].type == "refusal"


def test_the_engines_reasoning_becomes_a_reasoning_item_first() -> None:
    out = from_chat(
        chat_answer({"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4"}),
        REQUEST,
    )
    resp = Response.model_validate(out)
    first = resp.output[0]
    assert first.type == "reasoning" and first.content is not None
    assert first.content[0].text == "2+2 is 4"
    assert resp.output_text == "4"


# -- the stream ----------------------------------------------------------------------


def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "e",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra,
    }


# As llama.cpp sends them: a role first, text, then a tool call whose name comes first
# and whose arguments come in pieces, then the finish, then the usage event.
TEXT_THEN_TOOL = [
    chunk({"role": "assistant", "content": None}),
    chunk({"content": "Let me "}),
    chunk({"content": "check."}),
    chunk({"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call_y", "type": "function",
                           "function": {"name": "get_time", "arguments": "{}"}}]}),
    chunk({}, "tool_calls"),
    {**chunk({}), "choices": [], "usage": USAGE},
]


def run_stream(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    t = StreamTranslator(REQUEST, model="route-model")
    events = t.start()
    for c in chunks:
        events += t.chunk(c)
    events += t.finish()
    assert t.finish() == []  # once only
    for e in events:
        EVENT.validate_python(e)  # each one is a valid Responses stream event
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


@pytest.mark.feature("M14")
def test_a_chat_stream_becomes_the_responses_events_in_openais_order() -> None:
    events = run_stream(TEXT_THEN_TOOL)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # get_weather
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.output_item.added",  # get_time, its arguments all in the first delta
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[6]["text"] == "Let me check."
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [(e["output_index"], e["arguments"]) for e in done] == [
        (1, '{"city":"Oslo"}'), (2, "{}")
    ]
    resp = Response.model_validate(events[-1]["response"])
    assert resp.status == "completed" and resp.output_text == "Let me check."
    assert [(i.type, getattr(i, "call_id", None)) for i in resp.output] == [
        ("message", None), ("function_call", "call_x"), ("function_call", "call_y")
    ]
    assert resp.usage is not None and resp.usage.total_tokens == 17
    # each item's id is the same in its added, delta and done events and in the Response
    assert events[2]["item"]["id"] == events[4]["item_id"] == resp.output[0].id


def test_streamed_reasoning_is_its_own_item_before_the_message() -> None:
    events = run_stream(
        [
            chunk({"role": "assistant", "reasoning_content": "2+2"}),
            chunk({"reasoning_content": " is 4"}),
            chunk({"content": "4"}),
            chunk({}, "stop"),
        ]
    )
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[6]["text"] == "2+2 is 4"
    resp = Response.model_validate(events[-1]["response"])
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert resp.output_text == "4"


def test_a_stream_cut_by_the_length_limit_ends_incomplete() -> None:
    events = run_stream([chunk({"content": "Hel"}), chunk({}, "length")])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-2]["item"]["status"] == "incomplete"


def test_a_stream_error_becomes_an_error_event_and_response_failed() -> None:
    t = StreamTranslator(REQUEST, model="route-model")
    events = t.start() + t.chunk(chunk({"content": "Hel"}))
    events += t.fail("The model backend's stream ended unexpectedly.", "upstream_error")
    assert t.finish() == []
    for e in events:
        EVENT.validate_python(e)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"]["code"] == "server_error"


# -- the ASGI exit -------------------------------------------------------------------


def exit_run(start: Message, bodies: list[bytes]) -> list[Message]:
    sent: list[Message] = []

    async def send(msg: Message) -> None:
        sent.append(msg)

    async def go() -> None:
        out = ResponsesExit(send, REQUEST, "route-model")
        await out(start)
        for i, b in enumerate(bodies):
            await out({"type": "http.response.body", "body": b,
                       "more_body": i < len(bodies) - 1})

    asyncio.run(go())
    return sent


def sse_events(sent: list[Message]) -> list[dict[str, Any]]:
    data = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    out = []
    for block in data.split(b"\n\n"):
        if block:
            name, payload = block.split(b"\n")
            event = orjson.loads(payload.removeprefix(b"data: "))
            assert name == b"event: " + event["type"].encode()
            out.append(event)
    return out


@pytest.mark.feature("M14")
def test_the_exit_sends_a_json_answer_as_a_response_with_its_own_length() -> None:
    answer = orjson.dumps(chat_answer({"role": "assistant", "content": "Hi"}))
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", b"%d" % len(answer))]}
    sent = exit_run(start, [answer[:10], answer[10:]])
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    body = sent[1]["body"]
    assert dict(sent[0]["headers"])[b"content-length"] == b"%d" % len(body)
    assert Response.model_validate_json(body).output_text == "Hi"


@pytest.mark.feature("M14")
def test_the_exit_translates_a_stream_whose_events_are_split_anywhere() -> None:
    raw = b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in TEXT_THEN_TOOL)
    raw += b"data: [DONE]\n\n"
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"text/event-stream")]}
    sent = exit_run(start, [raw[i : i + 7] for i in range(0, len(raw), 7)])
    assert sent[0] == start
    assert sent[-1]["more_body"] is False
    events = sse_events(sent)
    assert [e["type"] for e in events] == [e["type"] for e in run_stream(TEXT_THEN_TOOL)]
    assert Response.model_validate(events[-1]["response"]).output_text == "Let me check."


def test_the_exit_turns_the_gateways_stream_error_into_response_failed() -> None:
    broken = b'data: {"error":{"message":"cut","type":"server_error","param":null,'
    broken += b'"code":"upstream_error"}}\n\n'
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"text/event-stream")]}
    first = b"data: " + orjson.dumps(chunk({"content": "Hel"})) + b"\n\n"
    events = sse_events(exit_run(start, [first, broken]))
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["code"] == "upstream_error" and events[-2]["message"] == "cut"


def test_the_exit_passes_errors_through_untouched() -> None:
    err = errors.invalid_request("bad", "messages").body()
    start = {"type": "http.response.start", "status": 400,
             "headers": [(b"content-type", b"application/json")]}
    sent = exit_run(start, [err])
    assert sent[0] is start and sent[1]["body"] == err
