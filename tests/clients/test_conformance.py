"""Every kind of answer the gateway gives, validated against OpenAI's schema.

The raw bytes (not an SDK's lenient parse) of each answer in front of a real llama.cpp
engine — chat, its stream chunks, legacy completions and their stream, embeddings,
the model list and a model, and the error bodies of 400, 401, 404, 405, 413, 429 and
503 — must conform to the response types the ``openai`` package ships
(``conformance.assert_conforms``: required keys present, types exact, pydantic strict).
The first tests prove that the checker itself catches what the issue saw engines do.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from openai.types.responses import Response

from heteroflow.gateway.inbound import MAX_BODY_BYTES
from tests.clients.conftest import (
    EMPTY_MODEL,
    KEY,
    LIMITED_KEY,
    MODEL,
    OVERLONG_PROMPT,
    Stack,
)
from tests.openai_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    CompletionChunk,
    CreateEmbeddingResponse,
    ErrorResponse,
    Model,
    ModelList,
    assert_conforms,
    conformance_errors,
)

CHAT: dict[str, Any] = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Hello"}],
    "max_tokens": 8,
    "temperature": 0,
}
PROMPT: dict[str, Any] = {"model": MODEL, "prompt": "Once upon", "max_tokens": 8, "temperature": 0}


def _sse(gw: Stack, path: str, body: dict[str, Any]) -> tuple[httpx.Response, list[Any]]:
    """POST a stream; its response and the JSON of every ``data:`` event but ``[DONE]``,
    which must be the last one."""
    events: list[str] = []
    with httpx.stream(
        "POST",
        f"{gw.url}{path}",
        json=body,
        headers={"authorization": f"Bearer {KEY}"},
        timeout=60.0,
    ) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line]
    assert events and events[-1] == "[DONE]", events[-3:]
    return resp, [json.loads(e) for e in events[:-1]]


# The checker itself: it catches what the issue saw engines send.


def test_checker_catches_an_engine_error_shape() -> None:
    llama = {"error": {"code": 400, "message": "too long", "type": "exceed_context_size_error"}}
    problems = conformance_errors(llama, ErrorResponse)
    assert "$.error.code: expected str, got 400" in problems
    assert "$.error.param: required by ErrorObject, missing" in problems
    assert_conforms(
        {"error": {"code": None, "param": None, "message": "m", "type": "t"}}, ErrorResponse
    )


def test_checker_wants_the_nullable_required_keys_and_exact_types() -> None:
    choice: dict[str, Any] = {
        "index": 0,
        "finish_reason": "length",
        "message": {"role": "assistant", "content": "hi"},
    }
    chat: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [choice],
        "timings": {},  # an engine's extra key is allowed
    }
    assert conformance_errors(chat, ChatCompletion) == [
        "$.choices[0].logprobs: required by Choice, missing",
        "$.choices[0].message.refusal: required by ChatCompletionMessage, missing",
    ]
    choice["logprobs"] = None
    choice["message"]["refusal"] = None
    assert_conforms(chat, ChatCompletion)
    chat["created"] = 1.5
    choice["finish_reason"] = "eos"
    assert conformance_errors(chat, ChatCompletion) == [
        "$.choices[0].finish_reason: 'eos' is not one of "
        "['stop', 'length', 'tool_calls', 'content_filter', 'function_call']",
        "$.created: expected int, got 1.5",
    ]
    del chat["id"]
    assert "$.id: required by ChatCompletion, missing" in conformance_errors(chat, ChatCompletion)


# What the gateway answers in front of llama.cpp.


@pytest.mark.feature("M13")
def test_chat_completion_conforms(gw: Stack) -> None:
    resp = gw.post("/chat/completions", CHAT)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert_conforms(body, ChatCompletion)
    assert body["id"].startswith("chatcmpl-")


@pytest.mark.feature("M13")
def test_chat_stream_chunks_conform(gw: Stack) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    resp, chunks = _sse(gw, "/chat/completions", body)
    for chunk in chunks:
        assert_conforms(chunk, ChatCompletionChunk)
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    assert all(c.get("usage") is None for c in chunks[:-1])
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert resp.headers.get("cache-control") == "no-cache"


@pytest.mark.feature("M13")
def test_completion_conforms(gw: Stack) -> None:
    resp = gw.post("/completions", PROMPT)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert_conforms(body, Completion)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert len(body["choices"][0]["text"]) == 8


@pytest.mark.feature("M13")
def test_completion_logprobs_have_the_completions_shape(gw: Stack) -> None:
    resp = gw.post("/completions", {**PROMPT, "max_tokens": 3, "logprobs": 2})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert_conforms(body, Completion)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs is not None
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 3
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    assert "".join(logprobs["tokens"]) == body["choices"][0]["text"]


@pytest.mark.feature("M13")
def test_completion_echo_repeats_the_prompt(gw: Stack) -> None:
    resp = gw.post("/completions", {**PROMPT, "echo": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"].startswith("Once upon")


@pytest.mark.feature("M13")
def test_completion_stream_chunks_conform(gw: Stack) -> None:
    _, chunks = _sse(gw, "/completions", {**PROMPT, "stream": True})
    text = ""
    for chunk in chunks:
        assert_conforms(chunk, CompletionChunk)
        assert chunk["object"] == "text_completion" and chunk["id"].startswith("cmpl-")
        text += "".join(choice["text"] for choice in chunk["choices"])
    assert len(text) == 8
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.feature("M13")
def test_embeddings_conform(gw: Stack) -> None:
    resp = gw.post("/embeddings", {"model": MODEL, "input": ["a", "b"], "encoding_format": "float"})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert_conforms(body, CreateEmbeddingResponse)
    assert [d["index"] for d in body["data"]] == [0, 1]


@pytest.mark.feature("M13")
def test_models_conform(gw: Stack) -> None:
    headers = {"authorization": f"Bearer {KEY}"}
    listed = httpx.get(f"{gw.url}/models", headers=headers, timeout=10)
    assert listed.status_code == 200
    assert_conforms(listed.json(), ModelList)
    one = httpx.get(f"{gw.url}/models/{MODEL}", headers=headers, timeout=10)
    assert one.status_code == 200
    assert_conforms(one.json(), Model)
    # `created` is a real time (seconds), not 0
    for model in [*listed.json()["data"], one.json()]:
        assert model["created"] > time.time() - 10 * 365 * 86400


@pytest.mark.feature("M14")
def test_responses_conform(gw: Stack) -> None:
    resp = gw.post("/responses", {"model": MODEL, "input": "Hello", "max_output_tokens": 8})
    assert resp.status_code == 200, resp.text
    assert_conforms(resp.json(), Response)


def _error(resp: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body: dict[str, Any] = resp.json()
    assert_conforms(body, ErrorResponse)
    assert resp.headers["content-type"].startswith("application/json")
    if code is not None:
        assert body["error"]["code"] == code, body
    error: dict[str, Any] = body["error"]
    return error


@pytest.mark.feature("M13")
def test_client_errors_conform(gw: Stack) -> None:
    _error(gw.post("/chat/completions", CHAT, key="sk-wrong"), 401, "invalid_api_key")
    _error(gw.post("/chat/completions", CHAT, key=None), 401, "invalid_api_key")
    _error(gw.post("/chat/completions", {**CHAT, "model": "nope"}), 404, "model_not_found")
    _error(httpx.post(f"{gw.url}/nowhere", timeout=10), 404)
    _error(httpx.get(f"{gw.url}/chat/completions", timeout=10), 405)
    bad_json = httpx.post(
        f"{gw.url}/chat/completions",
        content=b"{not json",
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        timeout=10,
    )
    _error(bad_json, 400)
    temperature = _error(gw.post("/chat/completions", {**CHAT, "temperature": 5}), 400)
    assert temperature["param"] == "temperature"
    empty = _error(gw.post("/chat/completions", {**CHAT, "messages": []}), 400)
    assert empty["param"] == "messages"


@pytest.mark.feature("M13")
def test_engine_errors_conform(gw: Stack) -> None:
    overlong = {**CHAT, "messages": [{"role": "user", "content": OVERLONG_PROMPT}]}
    error = _error(gw.post("/chat/completions", overlong), 400, "context_length_exceeded")
    assert error["type"] == "invalid_request_error"
    prompt = {**PROMPT, "prompt": OVERLONG_PROMPT}
    _error(gw.post("/completions", prompt), 400, "context_length_exceeded")


@pytest.mark.feature("M13")
def test_too_large_body_conforms(gw: Stack) -> None:
    resp = httpx.post(
        f"{gw.url}/chat/completions",
        content=b" " * (MAX_BODY_BYTES + 1),
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        timeout=60,
    )
    _error(resp, 413)


@pytest.mark.feature("M13")
def test_rate_limited_and_unavailable_conform(gw: Stack) -> None:
    statuses = []
    for _ in range(3):
        resp = gw.post("/chat/completions", {**CHAT, "max_tokens": 1}, key=LIMITED_KEY)
        statuses.append(resp.status_code)
        if resp.status_code == 429:
            _error(resp, 429)
            break
    assert statuses[-1] == 429, statuses
    _error(gw.post("/chat/completions", {**CHAT, "model": EMPTY_MODEL}), 503, "no_healthy_backend")
