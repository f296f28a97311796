"""The gateway's capability check (issue 15 item 2): a clear 400 naming the field for a
request the model cannot answer; unknown capabilities never refuse."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.core.engines.capabilities import UNKNOWN, Capabilities
from heteroflow.gateway.routing.capability_check import refuse
from heteroflow.gateway.shaping.responses import to_chat
from heteroflow.schemas.routing import RouteTarget

pytestmark = pytest.mark.feature("M13")

CHAT = "/v1/chat/completions"
TEXT_ONLY = Capabilities(
    chat=True, tools=False, vision=False, embeddings=False, json_schema=False, context_length=100
)
EMBEDDER = Capabilities(chat=False, tools=False, vision=False, embeddings=True, json_schema=False)
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def targets(*caps: Capabilities) -> tuple[RouteTarget, ...]:
    return tuple(
        RouteTarget(f"r{i}", f"g{i}", 0, 1, (), capabilities=c) for i, c in enumerate(caps)
    )


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (CHAT, chat(messages=[{"role": "user", "content": [IMAGE]}]), "messages",
         "model 'm' does not accept image input"),
        (CHAT, chat(tools=[TOOL]), "tools", "model 'm' does not support tools"),
        (CHAT, chat(tools=[TOOL], tool_choice="required"), "tools", "does not support tools"),
        (CHAT, chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
         "response_format", "structured output"),
        ("/v1/embeddings", {"model": "m", "input": "x"}, "model", "does not support embeddings"),
        # /v1/responses arrives translated to its chat body; the param is the caller's
        ("/v1/responses", to_chat({"model": "m", "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:,"}]}]}), "input", "image input"),
        ("/v1/responses", to_chat({"model": "m", "input": "x", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {}}}}), "response_format",
         "structured output"),
    ],
)  # fmt: skip
def test_refused_with_the_field_named(
    path: str, body: dict[str, Any], param: str, message: str
) -> None:
    err = refuse(path, body, "m", targets(TEXT_ONLY))
    assert err is not None
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert message in err.message


def test_chat_on_an_embeddings_model_is_refused() -> None:
    for path in (CHAT, "/v1/completions", "/v1/responses"):
        err = refuse(path, chat(), "bge", targets(EMBEDDER))
        assert err is not None and err.param == "model" and "embeddings model" in err.message
    assert refuse("/v1/embeddings", {"input": "x"}, "bge", targets(EMBEDDER)) is None


def test_prompt_longer_than_the_context() -> None:
    long = chat(messages=[{"role": "user", "content": "word " * 100}])  # ~125 tokens > 100
    err = refuse(CHAT, long, "m", targets(TEXT_ONLY))
    assert err is not None
    assert (err.status, err.code, err.param) == (400, "context_length_exceeded", "messages")
    assert "exceed the configured limit of 100 tokens" in err.message
    prompt = refuse("/v1/completions", {"prompt": "x" * 800}, "m", targets(TEXT_ONLY))
    assert prompt is not None and prompt.param == "prompt"
    assert refuse(CHAT, chat(messages=[{"role": "user", "content": "x" * 400}]), "m",
                  targets(TEXT_ONLY)) is None  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, chat(max_tokens=1_000_000_000), "max_tokens"),
        (CHAT, chat(max_completion_tokens=101), "max_completion_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, "max_tokens"),
        ("/v1/responses", to_chat({"model": "m", "input": "x", "max_output_tokens": 500}),
         "max_output_tokens"),
    ],
)  # fmt: skip
def test_max_tokens_above_the_context_is_refused_as_openai_answers_it(
    path: str, body: dict[str, Any], param: str
) -> None:
    """Issue 33: max_tokens 1e9 on a 4,096-token model generated for minutes."""
    err = refuse(path, body, "m", targets(TEXT_ONLY))
    assert err is not None
    assert (err.status, err.type, err.code, err.param) == (
        400, "invalid_request_error", "invalid_value", param
    )
    assert err.message.startswith(f"{param} is too large: ")
    assert "maximum context length is 100 tokens" in err.message
    assert refuse(CHAT, chat(max_tokens=100), "m", targets(TEXT_ONLY)) is None
    assert refuse(CHAT, chat(max_tokens=10**9), "m", targets(UNKNOWN_CONTEXT)) is None


UNKNOWN_CONTEXT = Capabilities(chat=True, tools=True)


def test_what_the_model_can_do_passes() -> None:
    everything = Capabilities(True, True, True, True, True, None, None)
    body = chat(messages=[{"role": "user", "content": [IMAGE]}], tools=[TOOL],
                response_format={"type": "json_object"})  # fmt: skip
    assert refuse(CHAT, body, "m", targets(everything)) is None
    assert refuse(CHAT, chat(tools=[TOOL], tool_choice="none"), "m", targets(TEXT_ONLY)) is None
    assert refuse(CHAT, chat(tools=[]), "m", targets(TEXT_ONLY)) is None


def test_unknown_never_refuses() -> None:
    body = chat(messages=[{"role": "user", "content": [IMAGE]}], tools=[TOOL])
    assert refuse(CHAT, body, "m", targets(UNKNOWN)) is None
    assert refuse(CHAT, body, "m", ()) is None
    assert refuse("/v1/embeddings", {"input": "x"}, "m", targets(UNKNOWN)) is None


def test_refused_only_when_every_target_lacks_it() -> None:
    with_tools = Capabilities(chat=True, tools=True, vision=False)
    assert refuse(CHAT, chat(tools=[TOOL]), "m", targets(TEXT_ONLY, with_tools)) is None
    assert refuse(CHAT, chat(tools=[TOOL]), "m", targets(TEXT_ONLY, UNKNOWN)) is None
    both = targets(TEXT_ONLY, with_tools)
    assert refuse(CHAT, chat(messages=[{"role": "user", "content": [IMAGE]}]), "m", both)


def test_other_paths_are_not_checked() -> None:
    assert refuse("/v1/models", {"tools": [TOOL]}, "m", targets(EMBEDDER)) is None
