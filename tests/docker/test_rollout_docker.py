"""A rolling update on a real Docker Engine (J1): server + agent (Docker runtime), the
llama.cpp engine image, two replicas as containers, the OpenAI SDK sending a steady load
through the (embedded) gateway. Generation 1 -> 2 moves every replica to a container of
the new image tag, one at a time, with no request failing; the old containers are gone.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.docker.test_agent_on_docker import body, create, dstack  # noqa: F401 (a fixture)
from tests.e2e.conftest import Stack, wait_for
from tests.e2e.test_rolling_update import Load

NEW_TAG = "server-rollout-b2"


@pytest.mark.feature("J1")
def test_a_rolling_update_moves_every_container_to_the_new_image(
    dstack: Stack, docker_client: Any, engine_image: str  # noqa: F811
) -> None:
    repo = engine_image.rsplit(":", 1)[0]
    docker_client.images.get(engine_image).tag(repo, NEW_TAG)
    new_image = f"{repo}:{NEW_TAG}"
    g = create(dstack, body("rolld", parallelism="split", world_size=2))
    group_id, key = g["id"], g["api_key"]
    old = {t["id"] for t in dstack.wait_status(group_id, "running", 90)["tasks"]}
    load = Load(dstack.gateway_url, key, "rolld-model", streams=4)  # a small machine
    load.start()
    try:
        wait_for(lambda: load.ok >= 8, 60, "the load to flow")
        r = dstack.api(
            "PUT", f"/api/v1/task-groups/{group_id}/update",
            json={"image": new_image, "batch_size": 1},
        )
        assert r.status_code == 200, r.text

        def ended() -> dict[str, Any] | None:
            x = dstack.group(group_id)
            return x if x["rolling_update_state"] in ("done", "failed") else None

        try:
            final = wait_for(ended, 240, "the update to end", 0.5)
        except AssertionError as exc:  # say where it stood: which task waits, and why
            x = dstack.group(group_id)
            where = [
                (t["id"], t["generation"], t["status"], t["node_id"], t["status_message"][:300])
                for t in x["tasks"]
            ]
            raise AssertionError(
                f"{exc}\n{x['rolling_update_state']}: {x['rolling_update_message']}\n"
                f"tasks: {where}\n{dstack.logs()}"
            ) from None
        time.sleep(1)
    finally:
        load.finish()
    print(f"docker rolling update: {load.summary()}")
    assert final["rolling_update_state"] == "done", f"{final}\n{dstack.logs()}"
    assert load.failures == [], "\n".join(load.failures[:20])
    assert 503 not in {c for _, c in load.upstream_5xx}
    tasks = final["tasks"]
    assert {t["generation"] for t in tasks} == {2} and not old & {t["id"] for t in tasks}
    for t in tasks:
        c = docker_client.containers.get(t["id"])
        assert c.labels["heteroflow.generation"] == "2"
        assert new_image in c.image.tags
    live = {c.name for c in docker_client.containers.list()}

    def old_gone() -> bool:
        return not old & {c.name for c in docker_client.containers.list(all=True)}

    wait_for(old_gone, 30, "the old containers removed")
    assert {t["id"] for t in tasks} <= live
