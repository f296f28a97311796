"""LiteLLM as a client of the gateway in front of a real llama.cpp engine.

LiteLLM speaks to any OpenAI-compatible server as ``openai/<model>`` and maps the
server's errors onto its own exception classes by status and by OpenAI's error codes;
the gateway's answers must land in the right ones. LiteLLM is heavy to import (about
5 s here), so only this module imports it; its model price map is the packaged copy
(no network) and its callbacks are off.
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before the import: no fetch

import litellm
import pytest
from litellm.exceptions import (
    AuthenticationError,
    BadRequestError,
    ContextWindowExceededError,
    NotFoundError,
)
from litellm.litellm_core_utils.streaming_handler import CustomStreamWrapper
from litellm.types.utils import ModelResponse

from tests.clients.conftest import KEY, MODEL, OVERLONG_PROMPT, Stack

litellm.telemetry = False
litellm.suppress_debug_info = True
# LiteLLM's own use of pydantic warns; those warnings are not about the gateway
pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning:litellm.*", "ignore:.*ReadOnly.*:UserWarning"
)
MSG = [{"role": "user", "content": "Hello"}]


def _call(gw: Stack, **kwargs: object) -> ModelResponse | CustomStreamWrapper:
    args: dict[str, object] = {
        "model": f"openai/{MODEL}",
        "api_base": gw.url,
        "api_key": KEY,
        "messages": MSG,
        "max_tokens": 8,
        "temperature": 0,
        "num_retries": 0,
        "timeout": 60,
    }
    resp: ModelResponse | CustomStreamWrapper = litellm.completion(**(args | kwargs))
    return resp


def _complete(gw: Stack, **kwargs: object) -> ModelResponse:
    resp = _call(gw, **kwargs)
    assert isinstance(resp, ModelResponse)
    return resp


@pytest.mark.feature("M1")
def test_completion_and_stream(gw: Stack) -> None:
    resp = _complete(gw)
    content = resp.choices[0].message.content
    assert isinstance(content, str) and len(content) == 8
    assert resp.usage.completion_tokens == 8  # type: ignore[attr-defined]
    stream = _call(gw, stream=True, stream_options={"include_usage": True})
    assert isinstance(stream, CustomStreamWrapper)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == content
    usage = [u.completion_tokens for c in chunks if (u := getattr(c, "usage", None))]
    assert usage and usage[-1] == 8


@pytest.mark.feature("M12")
@pytest.mark.feature("M13")
def test_overlong_prompt_is_context_window_exceeded(gw: Stack) -> None:
    with pytest.raises(ContextWindowExceededError) as info:
        _complete(gw, messages=[{"role": "user", "content": OVERLONG_PROMPT}])
    assert info.value.status_code == 400


@pytest.mark.feature("M12")
def test_errors_have_litellm_classes(gw: Stack) -> None:
    with pytest.raises(AuthenticationError):
        _complete(gw, api_key="sk-not-a-key")
    with pytest.raises(NotFoundError):
        _complete(gw, model="openai/no-such-model")
    with pytest.raises(BadRequestError) as info:
        _complete(gw, temperature=5)
    assert info.value.status_code == 400
