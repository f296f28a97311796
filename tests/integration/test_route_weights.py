"""A4 end to end: weights and priorities set with ``PUT /api/v1/model-routes/{id}``
decide where real requests go.

Two groups serve one model name (the second through an added route); each group's task
runs on a fake engine reached by the host port the task publishes. Every change goes
through the management API, the routing snapshot is rebuilt from the database, and the
OpenAI SDK's requests through the server's own gateway show which engine answered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import Api, service_body

MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
MODEL = "chat-w"


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, int]]:
    """Two fake engines; answers' ids start with the engine's name ("a-…", "b-…")."""
    thread = UvicornThread()
    try:
        yield {
            name: thread.serve(FakeOpenAIBackend([f"engine-{name}"], name=name))
            for name in ("a", "b")
        }
    finally:
        thread.stop()


def running_group(api: Api, admin: dict[str, str], node_id: str, name: str, port: int) -> Any:
    """A service whose task publishes the fake engine's port, placed and running."""
    body = service_body(
        name=name, model_name=name, task={"ports": [{"container_port": 8000, "host_port": port}]}
    )
    r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
    assert r.status_code == 201, r.text
    g = r.json()
    task_id = g["tasks"][0]["id"]
    api.app.scheduler.run_round()
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200, r.text
    return g


def put_route(api: Api, admin: dict[str, str], route_id: str, **change: Any) -> None:
    r = api.client.put(f"/api/v1/model-routes/{route_id}", json=change, headers=admin)
    assert r.status_code == 200, r.text
    api.app.publisher.refresh()  # what the publisher loop does each round


@pytest.mark.feature("A4")
def test_weights_and_priorities_set_over_the_api_split_real_requests(
    api: Api, engines: dict[str, int]
) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    stable = running_group(api, admin, node_id, MODEL, engines["a"])
    canary = running_group(api, admin, node_id, "canary", engines["b"])
    [stable_route] = api.client.get(
        f"/api/v1/model-routes?group_id={stable['id']}", headers=admin
    ).json()
    r = api.client.post(
        "/api/v1/model-routes",
        json={"model_name": MODEL, "group_id": canary["id"]},
        headers=admin,
    )
    assert r.status_code == 201, r.text
    canary_route = r.json()["id"]
    client = openai.OpenAI(
        base_url="http://testserver/v1", api_key=stable["api_key"], http_client=api.client,
        max_retries=0,
    )

    def served(n: int) -> Counter[str]:
        return Counter(
            client.chat.completions.create(model=MODEL, messages=MSG).id[0] for _ in range(n)
        )

    put_route(api, admin, canary_route, weight=0)  # weight 0: fallback only
    assert served(6) == {"a": 6}
    put_route(api, admin, stable_route["id"], weight=0)
    put_route(api, admin, canary_route, weight=100)
    assert served(6) == {"b": 6}
    put_route(api, admin, stable_route["id"], weight=50)
    put_route(api, admin, canary_route, weight=50)
    split = served(20)
    assert split["a"] > 0 and split["b"] > 0 and split.total() == 20
    # priority 0 is served first; a lower priority only when the first has no backend
    put_route(api, admin, canary_route, priority=1)
    assert served(6) == {"a": 6}
    put_route(api, admin, canary_route, priority=0)
    put_route(api, admin, stable_route["id"], priority=1)
    assert served(6) == {"b": 6}
