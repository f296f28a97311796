"""LangChain's ``ChatOpenAI`` against the gateway in front of a real llama.cpp engine.

Agent frameworks rest on tool calls and structured output; LangChain also turns OpenAI's
error codes into its own error classes (``ContextOverflowError`` for
``context_length_exceeded``), which is what lets an agent trim its history and retry.
"""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.exceptions import (
    ContextOverflowError,
    ModelAuthenticationError,
    ModelNotFoundError,
)
from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, SecretStr

from tests.clients.conftest import (
    KEY,
    MODEL,
    OVERLONG_PROMPT,
    TOOL_MESSAGES,
    WEATHER_TOOL,
    Stack,
)


class Weather(BaseModel):
    """A forecast (structured output with a schema the grammar closes quickly)."""

    city: Literal["Paris", "Rome"]
    sunny: bool


def _chat(gw: Stack, key: str = KEY, model: str = MODEL, max_tokens: int = 8) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=gw.url,
        api_key=SecretStr(key),
        model=model,
        temperature=0,
        max_retries=0,
        timeout=60,
        max_completion_tokens=max_tokens,
    )


@pytest.mark.feature("M1")
def test_invoke_and_stream(gw: Stack) -> None:
    llm = _chat(gw)
    answer = llm.invoke("Hello")
    assert isinstance(answer, AIMessage)
    assert isinstance(answer.content, str) and len(answer.content) == 8
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] == 8
    chunks = list(llm.stream("Hello", stream_usage=True))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(str(c.content) for c in chunks) == answer.content
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert [u["output_tokens"] for u in usage] == [8]


@pytest.mark.feature("M13")
def test_bind_tools_gives_tool_calls(gw: Stack) -> None:
    llm = _chat(gw, max_tokens=200).bind_tools([WEATHER_TOOL], tool_choice="required")
    answer = llm.invoke(TOOL_MESSAGES)
    assert isinstance(answer, AIMessage)
    assert answer.tool_calls, answer
    assert {c["name"] for c in answer.tool_calls} == {"get_weather"}
    assert answer.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    assert answer.tool_calls[0]["id"]
    assert not answer.invalid_tool_calls


@pytest.mark.feature("M13")
def test_structured_output(gw: Stack) -> None:
    # LangChain's default method (json_schema: a grammar on llama.cpp). Its
    # "function_calling" method names the tool, which the random tiny model cannot be
    # steered into (see TOOL_MESSAGES): not tested here.
    llm = _chat(gw, max_tokens=200).with_structured_output(Weather, method="json_schema")
    answer = llm.invoke(TOOL_MESSAGES[:1])  # the question alone: the grammar shapes it
    assert isinstance(answer, Weather)
    assert answer.city in ("Paris", "Rome")


@pytest.mark.feature("M12")
@pytest.mark.feature("M13")
def test_overlong_prompt_raises_context_overflow(gw: Stack) -> None:
    with pytest.raises(ContextOverflowError):
        _chat(gw, max_tokens=4).invoke(OVERLONG_PROMPT)


@pytest.mark.feature("M12")
def test_auth_and_model_errors_have_langchain_classes(gw: Stack) -> None:
    with pytest.raises(ModelAuthenticationError):
        _chat(gw, key="sk-not-a-key").invoke("Hello")
    with pytest.raises(ModelNotFoundError):
        _chat(gw, model="no-such-model").invoke("Hello")
