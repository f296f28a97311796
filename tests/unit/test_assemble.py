"""Non-stream answers assembled from a stream's events (issue 15, item 6: ``assemble``).

The streams are llama.cpp's own (captured from xllamacpp 2026.10.11549 on the tiny
model), cut into byte chunks at awkward places; the answers must be what a non-stream
request gets, in OpenAI's schema (``tests.openai_schema``, strict).
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import pytest

from heteroflow.gateway.assemble import PATHS, Assembler, as_stream
from heteroflow.gateway.policy.usage import Usage, UsageTracker
from heteroflow.gateway.shaping import normalize
from heteroflow.gateway.wire.errors import OpenAIError
from tests.openai_schema import ChatCompletion, Completion, assert_conforms, conforms

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HEAD = {"created": 1796092528, "id": "chatcmpl-Luhs", "model": "tiny",
        "system_fingerprint": "b0-unknown"}  # fmt: skip
USAGE = {"completion_tokens": 5, "prompt_tokens": 31, "total_tokens": 36,
         "prompt_tokens_details": {"cached_tokens": 30}}  # fmt: skip
TIMINGS = {"prompt_n": 1, "predicted_n": 5}


def _chunk(*choices: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"choices": list(choices), **HEAD, "object": "chat.completion.chunk", **extra}


def _delta(delta: dict[str, Any], index: int = 0, finish: str | None = None) -> dict[str, Any]:
    return {"finish_reason": finish, "index": index, "delta": delta}


def _sse(events: list[dict[str, Any]], done: bool = True) -> bytes:
    out = b"".join(b"data: " + orjson.dumps(e) + b"\n\n" for e in events)
    return out + (b"data: [DONE]\n\n" if done else b"")


def _assemble(path: str, stream: bytes, cut: int = 7) -> dict[str, Any] | OpenAIError:
    """Feed ``stream`` in chunks of ``cut`` bytes (events split anywhere)."""
    asm = Assembler(path)
    for i in range(0, len(stream), cut):
        asm.feed_sse(stream[i : i + cut])
    return asm.result()


def _answer(result: dict[str, Any] | OpenAIError) -> dict[str, Any]:
    assert isinstance(result, dict), result
    return result


TEXT_STREAM = [
    _chunk(_delta({"role": "assistant", "content": None})),
    *(_chunk(_delta({"content": c})) for c in "zS8H("),
    _chunk(_delta({}, finish="length")),
    _chunk(usage=USAGE, timings=TIMINGS),
]


@pytest.mark.feature("M13")
@pytest.mark.parametrize("cut", [1, 7, 100_000])
def test_a_chat_stream_becomes_the_chat_completion_a_non_stream_request_gets(cut: int) -> None:
    answer = _answer(_assemble(CHAT, _sse(TEXT_STREAM), cut))
    assert_conforms(answer, ChatCompletion)
    conforms(answer)
    assert answer == {
        **HEAD,
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "zS8H(", "refusal": None},
                "finish_reason": "length",
                "logprobs": None,
            }
        ],
        "usage": USAGE,
        "timings": TIMINGS,  # what llama.cpp adds to its non-stream answer too
    }


@pytest.mark.feature("M13")
def test_crlf_events_and_a_last_event_without_its_blank_line_are_read() -> None:
    stream = _sse(TEXT_STREAM).replace(b"\n", b"\r\n").removesuffix(b"\r\n\r\n")
    answer = _answer(_assemble(CHAT, stream, 5))
    assert answer["choices"][0]["message"]["content"] == "zS8H("


@pytest.mark.feature("M13")
def test_two_parallel_tool_calls_are_joined_by_their_index_over_several_chunks() -> None:
    def call(index: int, **fields: Any) -> dict[str, Any]:
        return _chunk(_delta({"tool_calls": [{"index": index, **fields}]}))

    events = [
        _chunk(_delta({"role": "assistant", "content": None})),
        _chunk(_delta({"reasoning_content": "Two cities, "})),
        _chunk(_delta({"reasoning_content": "two calls."})),
        call(0, id="call_a", type="function", function={"name": "get_weather", "arguments": ""}),
        call(0, function={"arguments": '{"city": '}),
        call(1, id="call_b", type="function", function={"name": "get_weather", "arguments": "{"}),
        call(0, function={"arguments": '"Paris"}'}),
        call(1, function={"arguments": '"city": "Rome"}'}),
        _chunk(_delta({}, finish="tool_calls")),
        _chunk(usage=USAGE),
    ]
    answer = _answer(_assemble(CHAT, _sse(events), 13))
    assert_conforms(answer, ChatCompletion)
    message = answer["choices"][0]["message"]
    assert message["content"] is None  # OpenAI's null beside tool calls
    assert message["reasoning_content"] == "Two cities, two calls."
    assert message["tool_calls"] == [
        {"id": "call_a", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_b", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ]  # fmt: skip
    assert answer["choices"][0]["finish_reason"] == "tool_calls"
    assert "reasoning_content" not in _answer(_assemble(CHAT, _sse(TEXT_STREAM)))["choices"][0][
        "message"
    ]


def _top(token: str, logprob: float) -> dict[str, Any]:
    return {"id": ord(token), "token": token, "bytes": [ord(token)], "logprob": logprob}


def _lp(token: str, logprob: float) -> dict[str, Any]:
    return {"content": [{**_top(token, logprob), "top_logprobs": [_top(token, logprob)]}]}


@pytest.mark.feature("M13")
def test_chat_logprobs_are_concatenated_in_token_order() -> None:
    events = [
        _chunk(_delta({"role": "assistant", "content": None})),
        _chunk({**_delta({"content": "z"}), "logprobs": _lp("z", -0.6)}),
        _chunk({**_delta({"content": "S"}), "logprobs": _lp("S", -1.8)}),
        _chunk(_delta({}, finish="length")),
        _chunk(usage=USAGE),
    ]
    answer = _answer(_assemble(CHAT, _sse(events)))
    assert_conforms(answer, ChatCompletion)
    content = answer["choices"][0]["logprobs"]["content"]
    assert [(t["token"], t["logprob"]) for t in content] == [("z", -0.6), ("S", -1.8)]


def _text(text: str, index: int = 0, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choice = {"text": text, "index": index, "logprobs": extra.pop("logprobs", None),
              "finish_reason": finish}  # fmt: skip
    return {"choices": [choice], **HEAD, "object": "text_completion", **extra}


# llama.cpp's completions stream: chat-shaped logprobs, usage on the last choice chunk
COMPLETION_STREAM = [
    _text("V", logprobs=_lp("V", -0.4)),
    _text("/", logprobs=_lp("/", -1.2)),
    _text("4", logprobs=_lp("4", -1.9)),
    _text("", finish="length", usage={**USAGE, "completion_tokens": 3}, timings=TIMINGS),
]


@pytest.mark.feature("M13")
def test_a_completions_stream_becomes_the_text_completion_with_legacy_logprobs() -> None:
    raw = _answer(_assemble(COMPLETIONS, _sse(COMPLETION_STREAM)))
    assert raw["object"] == "text_completion"
    assert raw["choices"][0]["text"] == "V/4"
    assert [t["token"] for t in raw["choices"][0]["logprobs"]["content"]] == ["V", "/", "4"]
    # the relay's door (``usage.assembled``): normalised as a non-stream answer is
    asked = normalize.asked(COMPLETIONS, {"prompt": "Hi", "logprobs": 1}, 1)
    assert isinstance(asked, normalize.Asked)
    tracker = UsageTracker(hide=False, asked=asked)
    data = tracker.assembled(raw)
    assert isinstance(data, bytes)
    answer = orjson.loads(data)
    assert_conforms(answer, Completion)
    conforms(answer)  # cmpl- id
    assert answer["choices"][0]["logprobs"] == {
        "tokens": ["V", "/", "4"],
        "token_logprobs": [-0.4, -1.2, -1.9],
        "top_logprobs": [{"V": -0.4}, {"/": -1.2}, {"4": -1.9}],
        "text_offset": [0, 1, 2],
    }
    assert tracker.usage == Usage(31, 3)


@pytest.mark.feature("M13")
def test_echo_is_applied_to_an_assembled_completion() -> None:
    asked = normalize.asked(COMPLETIONS, {"prompt": "Hi", "echo": True}, 1)
    assert isinstance(asked, normalize.Asked)
    events = [_text("V"), _text("/", finish="length", usage=USAGE)]
    data = UsageTracker(hide=False, asked=asked).assembled(
        _answer(_assemble(COMPLETIONS, _sse(events)))
    )
    assert isinstance(data, bytes)
    assert orjson.loads(data)["choices"][0]["text"] == "HiV/"


@pytest.mark.feature("M13")
def test_n_choices_interleaved_keep_their_order_and_the_usage_of_choice_0() -> None:
    # llama.cpp streams each choice's usage after its last chunk; its non-stream answer
    # carries choice 0's
    second = {**USAGE, "completion_tokens": 4}
    events = [
        _chunk(_delta({"role": "assistant", "content": None})),
        _chunk(_delta({"role": "assistant", "content": None}, index=1)),
        _chunk(_delta({"content": "a"}, index=1)),
        _chunk(_delta({"content": "x"})),
        _chunk(_delta({}, index=1, finish="stop")),
        _chunk(usage=second),
        _chunk(_delta({"content": "y"})),
        _chunk(_delta({}, finish="length")),
        _chunk(usage=USAGE),
    ]
    answer = _answer(_assemble(CHAT, _sse(events)))
    assert_conforms(answer, ChatCompletion)
    assert [(c["index"], c["message"]["content"], c["finish_reason"]) for c in answer["choices"]] \
        == [(0, "xy", "length"), (1, "a", "stop")]  # fmt: skip
    assert answer["usage"] == USAGE
    # completions: usage rides on the finishing chunk; a multi-prompt stream opens with null
    stream = b"data: null\n\n" + _sse(
        [
            _text("V"),
            _text("v", index=1),
            _text("", finish="length", usage=USAGE),
            _text("", index=1, finish="length", usage=second),
        ]
    )
    answer = _answer(_assemble(COMPLETIONS, stream))
    assert_conforms(answer, Completion)
    assert [c["text"] for c in answer["choices"]] == ["V", "v"]
    assert answer["usage"] == USAGE


@pytest.mark.feature("M13")
def test_an_error_event_becomes_the_error_it_says() -> None:
    error = {"error": {"code": 400, "message": "the request exceeds the available context size "
             "(2048 tokens), try increasing it", "type": "exceed_context_size_error"}}  # fmt: skip
    asm = Assembler(CHAT)
    asm.feed_sse(_sse([TEXT_STREAM[0], error], done=False))
    result = asm.result()
    assert isinstance(result, OpenAIError)
    assert asm.complete
    assert (result.status, result.code, result.param) == (
        400, "context_length_exceeded", "messages")  # fmt: skip
    # an error without a status: a 500 (a server error, not the client's)
    asm = Assembler(COMPLETIONS)
    asm.feed_sse(_sse([{"error": {"message": "slot crashed"}}], done=False))
    result = asm.result()
    assert isinstance(result, OpenAIError)
    assert result.status == 500 and result.type == "server_error"


@pytest.mark.feature("M13")
@pytest.mark.parametrize("stream", [_sse(TEXT_STREAM, done=False), b"", b"data: [DONE]\n\n"])
def test_a_stream_that_ends_early_is_a_502_not_a_truncated_answer(stream: bytes) -> None:
    asm = Assembler(CHAT)
    asm.feed_sse(stream)
    result = asm.result()
    assert isinstance(result, OpenAIError)
    assert (result.status, result.code) == (502, "upstream_error")


def test_only_generation_paths_are_assembled_and_usage_is_asked_for() -> None:
    assert {CHAT, COMPLETIONS} == PATHS
    body = {"model": "m", "prompt": "p", "max_tokens": 3}
    assert as_stream(body) == {**body, "stream": True, "stream_options": {"include_usage": True}}
    assert "stream" not in body  # the client's body is untouched (a failover may need it)


def test_assembling_a_64_token_answer_costs_well_under_a_millisecond() -> None:
    stream = _sse(
        [
            TEXT_STREAM[0],
            *(_chunk(_delta({"content": "tok"})) for _ in range(64)),
            *TEXT_STREAM[-2:],
        ]
    )
    chunks = [stream[i : i + 1024] for i in range(0, len(stream), 1024)]
    rounds = 200
    start = time.perf_counter()
    for _ in range(rounds):
        asm = Assembler(CHAT)
        for c in chunks:
            asm.feed_sse(c)
        answer = asm.result()
    per_request = (time.perf_counter() - start) / rounds
    assert isinstance(answer, dict) and len(answer["choices"][0]["message"]["content"]) == 192
    assert per_request < 0.002, per_request  # ~0.1 ms here; generous for a busy CI box
