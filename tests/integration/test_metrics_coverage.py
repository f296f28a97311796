"""Every /v1 request shows in the gateway's /metrics, whatever its outcome and path (P3).

A real gateway on a uvicorn socket in front of a fake engine, driven over HTTP: bad and
missing keys (401), a body that is not JSON (400), an unknown model (404), the model list
and one model (200 / 404), a wrong method (405), a rate limit (429), an engine error (5xx)
and successes on chat, completions and embeddings; then one scrape of /metrics. Labels
stay bounded: made-up model names and paths never become label values. The last test
does the same through a whole server (``ServerApp``: API + gateway on one app).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
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
from tests.integration.conftest import Api

KEY = "sk-metrics-coverage-key-0001"
LIMITED_KEY = "sk-metrics-coverage-key-0002"  # one request a minute
TENANT = "tenant-m"
MSG = [{"role": "user", "content": "hi"}]
_SAMPLE = re.compile(r"^(heteroflow_gateway_requests_total\{.*\}) (\d+)$")


@dataclass
class Env:
    url: str
    app: GatewayApp

    def post(self, path: str, body: object, key: str | None = KEY) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        r = httpx.post(f"{self.url}{path}", json=body, headers=headers, timeout=10)
        return r.status_code

    def get(self, path: str, key: str | None = KEY) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=10).status_code


def _requests_total(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            out[m[1]] = int(m[2])
    return out


def _series(path: str, model: str, status: int) -> str:
    return f'heteroflow_gateway_requests_total{{path="{path}",model="{model}",status="{status}"}}'


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    engine = FakeOpenAIBackend(["engine-m"], name="m")
    engine_url = f"http://127.0.0.1:{thread.serve(engine)}"
    target = RouteTarget("r1", "g1", 0, 1, (Backend("task-m", engine_url),), "round_robin", ())
    holder = SnapshotHolder()
    models = frozenset({"chat", "embed"})
    holder.publish(
        RoutingSnapshot(
            version=1,
            keys={
                hash_key(KEY): KeyEntry("ep-m", TENANT, None, models),
                hash_key(LIMITED_KEY): KeyEntry("ep-l", TENANT, None, models, rpm_limit=1),
            },
            routes={(TENANT, "chat"): (target,), (TENANT, "embed"): (target,)},
        )
    )
    gateway = GatewayApp(holder)
    port = thread.serve(gateway)
    try:
        yield Env(f"http://127.0.0.1:{port}", gateway)
    finally:
        thread.call(gateway.aclose())
        thread.stop()


@pytest.mark.feature("P3")
def test_every_v1_request_is_counted_by_path_and_status(env: Env) -> None:
    chat, models = "/v1/chat/completions", "/v1/models"
    sent = {
        # outcome -> (what was sent, the series it must move)
        "bad key": (env.post(chat, {"model": "chat"}, key="sk-wrong"), _series(chat, "", 401)),
        "no key": (env.post(chat, {"model": "chat"}, key=None), _series(chat, "", 401)),
        "list, bad key": (env.get(models, key="sk-wrong"), _series(models, "", 401)),
        "list": (env.get(models), _series(models, "", 200)),
        "one model": (env.get(f"{models}/chat"), _series("/v1/models/{model}", "", 200)),
        "no such model": (env.get(f"{models}/nope"), _series("/v1/models/{model}", "", 404)),
        "not JSON": (env.post(chat, "not an object"), _series(chat, "", 400)),
        "unknown model": (
            env.post(chat, {"model": "made-up", "messages": MSG}), _series(chat, "", 404)
        ),
        "wrong method": (env.get(chat), _series(chat, "", 405)),
        "unknown path": (env.get("/v1/no/such/path"), _series("other", "", 404)),
        "chat": (env.post(chat, {"model": "chat", "messages": MSG}), _series(chat, "chat", 200)),
        "completion": (
            env.post("/v1/completions", {"model": "chat", "prompt": "hi"}),
            _series("/v1/completions", "chat", 200),
        ),
        "embeddings": (
            env.post("/v1/embeddings", {"model": "embed", "input": "hi"}),
            _series("/v1/embeddings", "embed", 200),
        ),
    }
    env.post(chat, {"model": "chat", "messages": MSG}, key=LIMITED_KEY)  # uses the minute's one
    sent["rate limited"] = (
        env.post(chat, {"model": "chat", "messages": MSG}, key=LIMITED_KEY),
        _series(chat, "chat", 429),
    )
    sent["engine error"] = (  # last: the engine is then ejected for a while
        env.post(chat, {"model": "chat", "messages": MSG, "fake_status": 503}),
        _series(chat, "chat", 503),
    )
    for what, (status, series) in sent.items():
        assert f'status="{status}"' in series, f"{what}: answered {status}, not as expected"

    scraped = httpx.get(f"{env.url}/metrics", timeout=10)
    assert scraped.status_code == 200
    counts = _requests_total(scraped.text)
    expected: dict[str, int] = {}
    for _, series in sent.values():
        expected[series] = expected.get(series, 0) + 1
    expected[_series(chat, "chat", 200)] += 1  # the limited key's first request
    missing = {s: n for s, n in expected.items() if counts.get(s) != n}
    assert not missing, f"not counted as expected: {missing}; scraped: {counts}"
    assert sum(counts.values()) == sum(expected.values())  # nothing else, nothing twice
    # the scrape itself is not a request to count
    assert not any('path="/metrics"' in s for s in counts)


@pytest.mark.feature("P3")
def test_made_up_models_and_paths_never_become_labels(env: Env) -> None:
    for i in range(5):
        env.post("/v1/chat/completions", {"model": f"made-up-{i}"})
        env.get(f"/v1/models/made-up-{i}")
        env.get(f"/v1/made-up-{i}")
        env.post("/v1/chat/completions", {"model": f"made-up-{i}"}, key=f"sk-made-up-{i}")
    text = httpx.get(f"{env.url}/metrics", timeout=10).text
    assert "made-up" not in text
    labels = {
        m[1]
        for line in text.splitlines()
        if (m := re.match(r'^heteroflow_gateway_requests_total\{path="([^"]*)"', line))
    }
    assert labels <= {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/models",
        "/v1/models/{model}",
        "other",
    }


@pytest.mark.feature("P3")
def test_the_server_counts_bad_keys_and_model_lists(api: Api) -> None:
    """The all-in-one server: /v1 and /metrics through the same app as the API."""
    c = api.client
    assert c.get("/v1/models", headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
    assert c.post("/v1/chat/completions", json={"model": "x"}).status_code == 401
    assert c.get("/v1/models").status_code == 401
    counts = _requests_total(c.get("/metrics").text)
    assert counts[_series("/v1/models", "", 401)] == 2
    assert counts[_series("/v1/chat/completions", "", 401)] == 1
