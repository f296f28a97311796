"""One real stack for the client-library tests: a llama.cpp engine behind the real gateway.

The engine is the launcher (``python -m heteroflow.engines.llamacpp_server``) on the tiny
test model's tool-calling variant (a chat template that renders ``tools``), with
embeddings on, two slots, one thread, and ``--jinja`` (llama.cpp's tool-call templates)
when the launcher accepts it. The gateway is ``GatewayApp`` on uvicorn in a background
thread, with a snapshot that routes ``tiny-chat`` to the engine, carrying the
capabilities the server derives for that engine and model. Both start once per test
session; every client library in this folder talks to the same gateway, as a
developer's program would.

The snapshot also holds what the error tests need: a model whose route has no backend
(503) and a key limited to one request a minute (429).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import openai
import pytest

from heteroflow.core.engines.capabilities import Capabilities, derive
from heteroflow.engines.llamacpp_server import LaunchArgsError, parse_args
from heteroflow.gateway.app import GatewayApp
from heteroflow.models.capabilities import model_facts
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.routing import (
    KeyEntry,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import UvicornThread
from tests.gateway_stack import serve_gateway, snapshot, start_engine

KEY = "sk-clients-0001"
LIMITED_KEY = "sk-clients-limited-0001"  # one request a minute (M8)
TENANT = "tenant-clients"
MODEL = "tiny-chat"
EMPTY_MODEL = "tiny-empty"  # routed, but its route has no backend: 503
ENGINE_ALIAS = "heteroflow-tiny"
# llama.cpp's context is shared by its slots: 4096 / 2 = 2048 tokens a request, and the
# tiny model's tokens are bytes, so this prompt cannot fit.
OVERLONG_PROMPT = "word " * 2000
# What a developer asks when a tool call must come back (tool_choice="required"). The
# tiny model's weights are random: it never starts a call by itself, and this llama.cpp
# lets text come before a call even when one is required. The assistant turn is therefore
# started with the template's call opener (a trained model writes it itself); from there
# the template, the grammar and the parser — what the platform switches on — do the rest.
TOOL_MESSAGES: list[dict[str, str]] = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": "<tool_call>\n"},
]
# A tool whose arguments the grammar pins down, so the tiny model's call ends quickly.
WEATHER_TOOL: dict[str, object] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def launcher_accepts(flag: str) -> bool:
    """Whether the launcher knows ``flag`` (parsed in process: no subprocess)."""
    try:
        parse_args(["-m", "model.gguf", flag])
    except LaunchArgsError:
        return False
    return True


@dataclass
class Stack:
    """The running engine and gateway, and clients for them."""

    thread: UvicornThread
    holder: SnapshotHolder
    gateway: GatewayApp
    port: int
    engine_url: str
    engine_log: Path  # llama.cpp's own log, for a failing test's investigation
    jinja: bool
    clients: list[openai.OpenAI] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The OpenAI base URL (with ``/v1``), as SDKs take it."""
        return f"http://127.0.0.1:{self.port}/v1"

    def openai(self, key: str = KEY) -> openai.OpenAI:
        """A sync OpenAI client that never retries (a retry would hide a 5xx)."""
        client = openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=60.0)
        self.clients.append(client)
        return client

    def post(self, path: str, body: object, key: str | None = KEY) -> httpx.Response:
        """A raw POST to ``/v1{path}``: the bytes the gateway answers, unparsed by an SDK."""
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        return httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=60.0)


def _snapshot(engine_url: str, capabilities: Capabilities) -> RoutingSnapshot:
    routes = {MODEL: (engine_url,), EMPTY_MODEL: ()}
    base = snapshot(routes, key=KEY, tenant=TENANT, capabilities=capabilities)
    limited = KeyEntry("endpoint-limited", TENANT, None, frozenset({MODEL}), rpm_limit=1)
    return replace(base, keys={**base.keys, hash_key(LIMITED_KEY): limited})


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("clients")
    model = write_tiny_gguf(root / "heteroflow-tiny-tools.gguf", tools=True)
    jinja = launcher_accepts("--jinja")
    log = root / "engine.log"
    flags = ["--embeddings", *(["--jinja"] if jinja else [])]
    with start_engine(model, log, *flags, alias=ENGINE_ALIAS, ready_s=60) as engine:
        # what the server puts on the route for this engine and model (issue 15)
        capabilities = derive("llamacpp", engine.argv, model_facts(str(model)))
        holder = SnapshotHolder(_snapshot(engine.url, capabilities))
        with serve_gateway(holder) as gw:
            yield Stack(gw.thread, holder, gw.app, gw.port, engine.url, log, jinja)


@pytest.fixture
def gw(stack: Stack) -> Iterator[Stack]:
    """The session's stack, with the sync clients a test made closed after it."""
    yield stack
    while stack.clients:
        stack.clients.pop().close()
