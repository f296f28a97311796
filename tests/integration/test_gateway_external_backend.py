"""A standalone gateway in front of an external OpenAI-compatible backend that wants its
own key: the gateway sends the provider's key (never the caller's), also for the model
list it uses to rename models."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from heteroflow.gateway.app import GatewayApp
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

CALLER_KEY = "sk-caller-of-the-gateway"
PROVIDER_KEY = "sk-provider-own-key"


@pytest.fixture
def served() -> Iterator[tuple[UvicornThread, FakeOpenAIBackend, SnapshotHolder, int]]:
    thread = UvicornThread()
    provider = FakeOpenAIBackend(["provider-model-v2"], name="provider")
    provider.required_key = PROVIDER_KEY
    url = f"http://127.0.0.1:{thread.serve(provider)}"
    target = RouteTarget(
        route_id="ext", group_id="ext", priority=0, weight=100,
        backends=(Backend(task_id=url, base_url=url, auth=f"Bearer {PROVIDER_KEY}"),),
    )
    holder = SnapshotHolder(RoutingSnapshot(
        version=1,
        keys={hash_key(CALLER_KEY): KeyEntry("edge", "default", None, frozenset({"smart"}))},
        routes={("default", "smart"): (target,)},
    ))
    gateway = GatewayApp(holder)
    port = thread.serve(gateway)
    try:
        yield thread, provider, holder, port
    finally:
        thread.call(gateway.aclose())
        thread.stop()


@pytest.mark.feature("M1")
@pytest.mark.feature("M6")
def test_the_provider_key_is_sent_and_the_caller_key_is_not(
    served: tuple[UvicornThread, FakeOpenAIBackend, SnapshotHolder, int],
) -> None:
    _, provider, _, port = served
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=CALLER_KEY,
                           max_retries=0, timeout=10)
    try:
        r = client.chat.completions.create(
            model="smart", messages=[{"role": "user", "content": "hi"}])
        assert r.choices[0].message.content
        # the route's name was renamed to the provider's own model id (its /v1/models)
        assert provider.received_models == ["provider-model-v2"]
        assert provider.models_requests >= 1
        chunks = list(client.chat.completions.create(
            model="smart", messages=[{"role": "user", "content": "hi"}], stream=True))
        assert chunks
    finally:
        client.close()
