"""Engine answers in OpenAI's shape, end to end (issue 15: items 4 and 5, M13, M5).

The real llama.cpp launcher (``python -m heteroflow.engines.llamacpp_server``) serves
the tiny model behind the real gateway on uvicorn; the real openai SDK and raw HTTP
call it. Two engines: ``chat`` with a small context and no embeddings (for context
overflow, and embeddings on a chat model), ``embed`` with ``--embeddings``. The chat
route has two backends (the same engine under two addresses), so a client's mistake
that ejected one would show.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionContentPartParam, ChatCompletionMessageParam

from heteroflow.gateway.app import GatewayApp
from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.gateway_stack import serve_gateway, snapshot, start_engine
from tests.openai_schema import conforms

KEY = "sk-test-normalise-0001"
ALIAS = "heteroflow-tiny"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]


@dataclass
class Engines:
    chat_url: str
    embed_url: str


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engines]:
    tmp = tmp_path_factory.mktemp("normalise")
    model = write_tiny_gguf(tmp / "tiny.gguf")
    with (
        # -c 64: llama.cpp makes it at least 256
        start_engine(model, tmp / "chat.log", "-c", "64", alias=ALIAS, slots=1) as chat,
        start_engine(model, tmp / "embed.log", "--embeddings", alias=ALIAS, slots=1) as embed,
    ):
        yield Engines(chat.url, embed.url)


@dataclass
class Gateway:
    app: GatewayApp
    url: str
    backends: tuple[str, str]  # the chat route's two backends


@pytest.fixture(scope="module")
def gateway(engines: Engines) -> Iterator[Gateway]:
    # the same engine under two addresses: two backends, as the gateway sees them
    second = engines.chat_url.replace("127.0.0.1", "localhost")
    routes = {
        "chat": (engines.chat_url, second),
        "embed": (engines.embed_url,),
    }
    with serve_gateway(snapshot(routes, key=KEY, tenant="tenant-1")) as gw:
        yield Gateway(gw.app, f"{gw.url}/v1", (engines.chat_url, second))


@pytest.fixture
def client(gateway: Gateway) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=30) as sdk:
        yield sdk


def _post(gateway: Gateway, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}{path}", json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=30
    )


def _events(resp: httpx.Response) -> list[dict[str, Any]]:
    data = [line[6:] for line in resp.text.split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [orjson.loads(d) for d in data[:-1]]


# --- errors --------------------------------------------------------------------------


@pytest.mark.feature("M13")
def test_context_overflow_is_context_length_exceeded(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hello " * 400}], max_tokens=4
        )
    assert info.value.code == "context_length_exceeded"
    assert info.value.param == "messages"
    assert info.value.type == "invalid_request_error"


@pytest.mark.feature("M13")
@pytest.mark.feature("M5")
def test_client_mistakes_are_400_and_never_eject(gateway: Gateway, client: openai.OpenAI) -> None:
    before = dict(gateway.app.metrics.ejections)
    image: list[ChatCompletionContentPartParam] = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]
    for _ in range(3):  # round robin: each backend gets at least one
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": image}], max_tokens=4
            )
        assert info.value.status_code == 400  # llama.cpp answers 500
        assert info.value.param == "messages"
        assert isinstance(info.value.body, dict)
        assert set(info.value.body) == {"message", "type", "param", "code"}
    assert gateway.app.metrics.ejections == before
    # both backends still route: the next good request is answered
    assert client.chat.completions.create(model="chat", messages=USER, max_tokens=2).choices


@pytest.mark.feature("M13")
def test_embeddings_on_a_chat_model_is_400_naming_the_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="chat", input="hi")  # llama.cpp: 501
    assert info.value.param == "model"
    assert info.value.code == "unsupported_model"


@pytest.mark.feature("M13")
def test_a_dimensions_the_model_cannot_give_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model="embed", input="hi", dimensions=8)
    assert info.value.param == "dimensions"
    size = len(client.embeddings.create(model="embed", input="hi").data[0].embedding)
    same = client.embeddings.create(model="embed", input="hi", dimensions=size)
    assert len(same.data[0].embedding) == size


# --- answers -------------------------------------------------------------------------


@pytest.mark.feature("M13")
def test_chat_answers_conform_to_openais_schema(gateway: Gateway) -> None:
    resp = _post(gateway, "/chat/completions", {"model": "chat", "messages": USER, "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    conforms(resp.json())  # llama.cpp leaves out logprobs and refusal


@pytest.mark.feature("M13")
@pytest.mark.parametrize("include_usage", [False, True])
def test_chat_stream_chunks_conform_and_usage_comes_last(
    gateway: Gateway, include_usage: bool
) -> None:
    body: dict[str, Any] = {"model": "chat", "messages": USER, "max_tokens": 3, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    chunks = _events(_post(gateway, "/chat/completions", body))
    for c in chunks:
        conforms(c)
    assert all("usage" not in c for c in chunks[:-1])
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    else:
        assert chunks[-1]["choices"] and "usage" not in chunks[-1]


@pytest.mark.feature("M13")
def test_completions_have_cmpl_ids_and_completions_logprobs(
    gateway: Gateway, client: openai.OpenAI
) -> None:
    sdk = client.completions.create(model="chat", prompt="hi", max_tokens=2)
    assert sdk.id.startswith("cmpl-")  # llama.cpp answers chatcmpl-
    resp = _post(
        gateway, "/completions", {"model": "chat", "prompt": "hi", "max_tokens": 2, "logprobs": 2}
    )
    obj = resp.json()
    conforms(obj)
    lp = obj["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 2
    assert "".join(lp["tokens"]) == obj["choices"][0]["text"]
    assert all(len(top) == 2 for top in lp["top_logprobs"])


@pytest.mark.feature("M13")
@pytest.mark.parametrize("include_usage", [False, True])
def test_a_completions_stream_conforms(gateway: Gateway, include_usage: bool) -> None:
    body: dict[str, Any] = {"model": "chat", "prompt": "hi", "max_tokens": 3, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    chunks = _events(_post(gateway, "/completions", body))
    for c in chunks:
        conforms(c)
        assert c["id"].startswith("cmpl-")
    usage_chunks = [c for c in chunks if "usage" in c]
    assert [c["choices"] for c in usage_chunks] == ([[]] if include_usage else [])


@pytest.mark.feature("M13")
def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="chat", prompt="hi", max_tokens=3, temperature=0)
    echoed = client.completions.create(
        model="chat", prompt="hi", max_tokens=3, temperature=0, echo=True
    )
    assert echoed.choices[0].text == "hi" + plain.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="chat", prompt="hi", max_tokens=1, echo=True, logprobs=1)
    assert info.value.param == "echo"


@pytest.mark.feature("M13")
def test_embeddings_and_models_conform(gateway: Gateway, client: openai.OpenAI) -> None:
    floats = _post(gateway, "/embeddings", {"model": "embed", "input": ["a", "b"]}).json()
    conforms(floats)
    b64 = _post(
        gateway, "/embeddings", {"model": "embed", "input": "a", "encoding_format": "base64"}
    ).json()
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert len(raw) == 4 * len(floats["data"][0]["embedding"])
    models = httpx.get(
        f"{gateway.url}/models", headers={"authorization": f"Bearer {KEY}"}, timeout=10
    ).json()
    for m in models["data"]:
        conforms(m)  # created is a real time, not 0
    assert {m.id for m in client.models.list()} >= {"chat", "embed"}
