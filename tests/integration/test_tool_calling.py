"""Tool calling on the real llama.cpp engine (issue 15 item 3), directly and through the gateway.

Two launcher processes serve the tiny model: the tool-calling variant (a Hermes-format
template, ``write_tiny_gguf(tools=True)``) and the plain one (ChatML without tools). The
random tiny model never starts a tool call on its own (the grammar llama.cpp builds for
``tool_choice: "required"`` lets free text precede the call), so the tests that need a call
prefill the assistant turn with ``<tool_call>``: from there the grammar forces the rest,
and a ``tool_calls`` array coming back proves the template, the grammar and the parser.
The gateway's route carries the capabilities derived from each engine's real argv and
model file, as the server derives them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest

from heteroflow.core.engines.capabilities import derive
from heteroflow.models.capabilities import model_facts
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.routing import RouteTarget
from tests.gateway_stack import serve_gateway, snapshot, start_engine, target

pytestmark = pytest.mark.feature("M13")

KEY = "sk-tool-calling-test-0001"
TENANT = "tenant-1"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris"]}},
            "required": ["city"],
        },
    },
}
ASK = {"role": "user", "content": "Weather in Paris?"}
PREFILL = {"role": "assistant", "content": "<tool_call>\n"}


class Engine:
    def __init__(self, model: Path, log: Path, *extra: str) -> None:
        self.model = model
        self.running = start_engine(model, log, "--jinja", *extra, alias="tiny", slots=None)
        self.argv = self.running.argv
        self.url = self.running.url

    def chat(self, **body: Any) -> dict[str, Any]:
        body = {"max_tokens": 128, "temperature": 0, **body}
        resp = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=30)
        assert resp.status_code == 200, resp.text
        return dict(resp.json())

    def target(self, name: str) -> RouteTarget:
        caps = derive("llamacpp", self.argv, model_facts(str(self.model)))
        return target(name, self.url, capabilities=caps)

    def stop(self) -> None:
        self.running.stop()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Engine]]:
    d = tmp_path_factory.mktemp("tool-models")
    started = {
        "tools": Engine(write_tiny_gguf(d / "tiny-tools.gguf", tools=True), d / "tools.log"),
        "plain": Engine(write_tiny_gguf(d / "tiny.gguf"), d / "plain.log"),
        "nojinja": Engine(d / "tiny-tools.gguf", d / "nojinja.log", "--no-jinja"),
    }
    yield started
    for e in started.values():
        e.stop()


@pytest.fixture(scope="module")
def gateway(engines: dict[str, Engine]) -> Iterator[openai.OpenAI]:
    routing = snapshot(
        {name: e.target(name) for name, e in engines.items()}, key=KEY, tenant=TENANT
    )
    with (
        serve_gateway(routing) as gw,
        openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0) as client,
    ):
        yield client


def test_required_tool_call_comes_back_as_tool_calls(engines: dict[str, Engine]) -> None:
    answer = engines["tools"].chat(messages=[ASK, PREFILL], tools=[WEATHER], tool_choice="required")
    [call] = answer["choices"][0]["message"]["tool_calls"][:1]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}


def test_tools_reach_the_prompt_only_with_a_tool_template(engines: dict[str, Engine]) -> None:
    def prompt_tokens(engine: Engine, **extra: Any) -> int:
        return int(engine.chat(messages=[ASK], max_tokens=1, **extra)["usage"]["prompt_tokens"])

    tools, plain = engines["tools"], engines["plain"]
    assert prompt_tokens(tools, tools=[WEATHER]) > prompt_tokens(tools) + 100  # rendered
    assert prompt_tokens(plain, tools=[WEATHER]) == prompt_tokens(plain)  # silently ignored


def test_a_tool_round_trip_renders(engines: dict[str, Engine]) -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    history = [ASK, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]  # fmt: skip
    assert engines["tools"].chat(messages=history, tools=[WEATHER])["choices"]


def test_capabilities_derived_from_the_real_engines(engines: dict[str, Engine]) -> None:
    caps = {name: e.target(name).capabilities for name, e in engines.items()}
    assert (caps["tools"].tools, caps["plain"].tools, caps["nojinja"].tools) == (True, False, False)
    assert caps["tools"].context_length == 2048  # launcher 4096, capped at the trained 2048
    assert caps["plain"].embeddings is False and caps["plain"].vision is False


def test_tool_calls_through_the_gateway(gateway: openai.OpenAI) -> None:
    resp = gateway.chat.completions.create(
        model="tools", messages=cast(Any, [ASK, PREFILL]), tools=cast(Any, [WEATHER]),
        tool_choice="required", max_tokens=128, temperature=0,
    )  # fmt: skip
    calls = resp.choices[0].message.tool_calls
    assert calls and cast(Any, calls[0]).function.name == "get_weather"


@pytest.mark.parametrize("model", ["plain", "nojinja"])
def test_the_gateway_refuses_tools_a_model_cannot_call(gateway: openai.OpenAI, model: str) -> None:
    # plain: the engine would answer 200 with text; --no-jinja: it would answer a 500
    with pytest.raises(openai.BadRequestError) as caught:
        gateway.chat.completions.create(
            model=model, messages=cast(Any, [ASK]), tools=cast(Any, [WEATHER]), max_tokens=4
        )
    assert caught.value.status_code == 400
    assert cast(Any, caught.value).param == "tools"
    assert f"model '{model}' does not support tools" in caught.value.message


def test_the_gateway_refuses_embeddings_and_images(gateway: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="does not support embeddings"):
        gateway.embeddings.create(model="plain", input="x")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="does not accept image input"):
        gateway.chat.completions.create(
            model="plain", messages=cast(Any, [{"role": "user", "content": [image]}]),
            max_tokens=4,
        )  # fmt: skip
