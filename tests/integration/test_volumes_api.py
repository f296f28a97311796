"""Volumes and preemption per task (A2, B4) through the API on a real database: create,
dry run and their 400s, the scheduler's node gate, the heartbeat's assignment, preemption
skipping a non-preemptible task, and a rolling update and a rebuild inheriting both."""

from __future__ import annotations

from typing import Any

import pytest

from .conftest import Api, service_body
from .test_fault_events import start
from .test_recovery import fail, recovery_round
from .test_rollout import put_update, roll_one_batch, two_replicas
from .test_scheduler_policies import create, h100s, job, run, task

LORA = {"host_path": "/models/loras", "container_path": "/mnt/loras"}
CACHE = {"host_path": "/m/hub", "container_path": "/root/.cache/huggingface", "read_only": False}
NEW_IMAGE = "ghcr.io/ggml-org/llama.cpp:server-b2"


def post(api: Api, headers: dict[str, str], body: dict[str, Any], dry: bool = False) -> Any:
    path = "/api/v1/task-groups" + ("?dry_run=true" if dry else "")
    return api.client.post(path, json=body, headers=headers)


def refused(api: Api, headers: dict[str, str], volumes: list[dict[str, Any]]) -> tuple[str, str]:
    """(field, message) of the 400 for a service with ``volumes``; the dry run says the
    same, and nothing is written."""
    body = service_body(task={"volumes": volumes})
    r = post(api, headers, body)
    assert r.status_code == 400, r.text
    dry = post(api, headers, body, dry=True)
    assert dry.status_code == 400 and dry.json() == r.json(), dry.text
    assert api.client.get("/api/v1/task-groups", headers=headers).json() == []
    err = r.json()["error"]
    return str(err["field"]), str(err["message"])


@pytest.mark.feature("A2")
def test_volumes_are_stored_read_only_by_default_and_shown_in_the_dry_run(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    body = service_body(task={"volumes": [LORA, CACHE]})
    dry = post(api, admin, body, dry=True)
    assert dry.status_code == 200, dry.text
    mounts = dry.json()["tasks"][0]["container"]["mounts"]
    assert mounts == [
        {"source": "/data/models/tiny.gguf", "target": "/data/models/tiny.gguf",
         "read_only": True},
        {"source": "/models/loras", "target": "/mnt/loras", "read_only": True},
        {"source": "/m/hub", "target": "/root/.cache/huggingface", "read_only": False},
    ]
    r = post(api, admin, body)
    assert r.status_code == 201, r.text
    t = r.json()["tasks"][0]
    assert t["volumes"] == [{**LORA, "read_only": True}, CACHE]
    assert t["preemptible"] is True
    # the agent gets them with its assignment (it checks them again before the launch)
    api.app.scheduler.run_round()
    beat = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "docker",
              "allowed_volume_prefixes": ["/models", "/m", "/data/models"],
              "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384}},
        headers={"Authorization": "Bearer node-token-for-tests"},
    )
    (assigned,) = beat.json()["tasks"]
    assert assigned["volumes"] == [{**LORA, "read_only": True}, CACHE]


@pytest.mark.feature("A2", "C4")
@pytest.mark.parametrize(
    ("volume", "field", "words"),
    [
        ({"host_path": "/etc", "container_path": "/mnt/x"}, "host_path",
         "outside the allowed volume prefixes"),
        ({"host_path": "models/loras", "container_path": "/mnt/x"}, "host_path",
         "must be an absolute path on the node"),
        ({"host_path": "/models/../etc", "container_path": "/mnt/x"}, "host_path",
         "'..' segment"),
        ({"host_path": "/models/a", "container_path": "mnt/x"}, "container_path",
         "must be an absolute path in the container"),
        ({"host_path": "/models/a", "container_path": "/etc/ssl"}, "container_path",
         "system path"),
        ({"host_path": "/models/a", "container_path": "/usr"}, "container_path",
         "system path"),
        ({"host_path": "/models/a", "container_path": "/"}, "container_path",
         "whole image"),
        ({"host_path": "/models/a", "container_path": "/data/models"}, "container_path",
         "which the platform mounts for this task"),
        ({"host_path": "/models/a", "container_path": "/heteroflow/x"}, "container_path",
         "which the platform mounts for this task"),
    ],
)
def test_a_volume_the_rules_refuse_is_a_400_naming_its_field(
    api: Api, volume: dict[str, Any], field: str, words: str
) -> None:
    admin = api.login()
    api.heartbeat()
    got_field, message = refused(api, admin, [LORA, volume])
    assert got_field == f"task.volumes[1].{field}", message
    assert words in message, message


@pytest.mark.feature("A2")
def test_two_volumes_on_one_container_path_and_a_denied_prefix_are_refused(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    field, message = refused(api, admin, [LORA, {**LORA, "host_path": "/models/other"}])
    assert field == "task.volumes[1].container_path" and "also volume 0" in message
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "docker",
              "allowed_volume_prefixes": ["/models", "/data/models"],
              "denied_volume_prefixes": ["/models/secret"],
              "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384}},
        headers={"Authorization": "Bearer node-token-for-tests"},
    )
    assert r.status_code == 200, r.text
    field, message = refused(
        api, admin, [{"host_path": "/models/secret/k", "container_path": "/mnt/k"}]
    )
    assert field == "task.volumes[0].host_path" and "denied volume prefix" in message
    # a bad shape is the schema's 400, naming the field too
    r = post(api, admin, service_body(task={"volumes": [{"host_path": "/models/a"}]}))
    assert r.status_code == 400 and r.json()["error"]["field"] == "task.volumes.0.container_path"


@pytest.mark.feature("A2")
def test_volumes_need_a_docker_node_the_process_runtime_mounts_nothing(api: Api) -> None:
    admin = api.login()
    api.heartbeat(name="proc", runtime="process")
    field, message = refused(api, admin, [LORA])
    assert field == "task.volumes" and "mounts nothing" in message
    # with a Docker node offline the create is taken; it waits rather than land on the
    # process node, and the pending reason says why
    api.heartbeat(name="dock", runtime="docker")
    api.clock.advance(3600)
    api.heartbeat(name="proc", runtime="process")
    r = post(api, admin, service_body(task={"volumes": [LORA]}))
    assert r.status_code == 201, r.text
    api.app.scheduler.run_round()
    t = task(api, admin, r.json()["tasks"][0]["id"])
    assert t["status"] == "pending" and "mounts nothing" in t["status_message"], t
    # the Docker node is back: the task goes there
    dock = api.heartbeat(name="dock", runtime="docker")
    api.app.scheduler.run_round()
    t = task(api, admin, t["id"])
    assert (t["status"], t["node_id"]) == ("scheduled", dock)


@pytest.mark.feature("A2")
def test_a_node_whose_allow_list_refuses_a_volume_is_never_chosen(api: Api) -> None:
    admin = api.login()
    api.heartbeat(name="narrow", allowed=["/data/models"])
    wide = api.heartbeat(name="wide", allowed=["/data/models", "/models"])
    r = post(api, admin, service_body(task={"volumes": [LORA]}))
    assert r.status_code == 201, r.text
    api.app.scheduler.run_round()
    assert task(api, admin, r.json()["tasks"][0]["id"])["node_id"] == wide


@pytest.mark.feature("A2", "B4")
def test_preemption_never_picks_a_task_that_is_not_preemptible(api: Api) -> None:
    admin = api.login()
    node = api.heartbeat(gpus=h100s(1))
    low = create(api, admin, job("low", priority=10, task={"preemptible": False}))
    low_id = low["tasks"][0]["id"]
    assert low["tasks"][0]["preemptible"] is False
    api.app.scheduler.run_round()
    run(api, node, low_id)
    urgent = create(api, admin, job("urgent", priority=500))
    r = api.app.scheduler.run_round()
    assert (r.placed, r.preempted) == (0, 0)
    assert task(api, admin, low_id)["status"] == "running"
    u = task(api, admin, urgent["tasks"][0]["id"])
    assert u["status"] == "pending" and u["status_message"].startswith("InsufficientResources")
    # a preemptible one beside it on a second card is taken instead
    node = api.heartbeat(gpus=h100s(2))
    api.app.scheduler.run_round()  # urgent takes the free card
    other = create(api, admin, job("other", priority=20))
    api.app.scheduler.run_round()
    assert task(api, admin, other["tasks"][0]["id"])["status"] == "pending"
    top = create(api, admin, job("top", priority=900))
    r = api.app.scheduler.run_round()
    assert r.preempted == 1
    # the preemptible one was moved (placed, not started: straight back to the queue)
    u = task(api, admin, urgent["tasks"][0]["id"])
    assert u["status"] == "pending" and u["status_message"].startswith("preempted by"), u
    assert top["tasks"][0]["id"] in u["status_message"]
    low_now = task(api, admin, low_id)
    assert (low_now["status"], low_now["preempted_by"]) == ("running", "")


@pytest.mark.feature("A2", "J3")
def test_a_rolling_update_keeps_volumes_and_preemptible(api: Api) -> None:
    admin = api.login()
    group_id, node_id, (old0, _old1) = two_replicas(
        api, admin, task={"volumes": [LORA], "preemptible": False}
    )
    code, g = put_update(api, admin, group_id, image=NEW_IMAGE, strategy="rolling")
    assert code == 200, g
    new0 = roll_one_batch(api, admin, node_id, group_id, old0)
    n0 = task(api, admin, new0)
    assert (n0["image"], n0["volumes"], n0["preemptible"]) == (
        NEW_IMAGE, [{**LORA, "read_only": True}], False
    )



@pytest.mark.feature("A2", "E1")
def test_a_rebuild_keeps_volumes_and_preemptible(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    r = post(api, admin, service_body(task={"volumes": [CACHE], "preemptible": False}))
    assert r.status_code == 201, r.text
    old = r.json()["tasks"][0]["id"]
    api.app.scheduler.run_round()
    start(api, node_id, old)
    fail(api, node_id, old)
    recovery_round(api)
    rebuilt = task(api, admin, old)["replaced_by"]
    assert rebuilt, task(api, admin, old)
    t = task(api, admin, rebuilt)
    assert (t["volumes"], t["preemptible"], t["status"]) == ([CACHE], False, "pending")


@pytest.mark.feature("A2")
def test_an_update_is_refused_when_its_inherited_volumes_no_longer_pass(api: Api) -> None:
    """The update checks its new generation as a create would: volumes included."""
    admin = api.login()
    group_id, _node, _ = two_replicas(api, admin, task={"volumes": [LORA]})
    api.heartbeat(allowed=["/data/models"])  # the node no longer allows /models
    code, body = put_update(api, admin, group_id, image=NEW_IMAGE)
    assert code == 400 and body["error"]["field"] == "volumes[0].host_path", body


@pytest.mark.feature("A2", "C7")
def test_files_may_be_requested_from_a_volume_as_from_the_model_mount(api: Api) -> None:
    admin = api.login()
    api.heartbeat()
    r = post(api, admin, service_body(task={"volumes": [LORA]}))
    assert r.status_code == 201, r.text
    task_id = r.json()["tasks"][0]["id"]
    api.app.scheduler.run_round()  # scheduled: files may be asked for

    def ask(path: str) -> Any:
        return api.client.post(
            "/api/v1/file-requests",
            json={"task_id": task_id, "request_type": "list", "target_path": path},
            headers=admin,
        )

    assert ask("/models/loras/sql").status_code == 201
    outside = ask("/models/other")
    assert outside.status_code == 400, outside.text
    assert "/models/loras" in outside.json()["error"]["message"]


@pytest.mark.feature("A2", "L2")
def test_a_create_with_volumes_is_never_answered_by_reusing_another_service(api: Api) -> None:
    """Dedup reuses a service of the same model and image; what a create mounts (a LoRA
    folder, a cache) is part of what it asks for, so one with volumes gets its own."""
    admin = api.login()
    node_id = api.heartbeat()
    on = api.client.put(
        "/api/v1/platform-settings", json={"inference_dedup_enabled": True}, headers=admin
    )
    assert on.status_code == 200, on.text
    first = post(api, admin, service_body(name="first"))
    assert first.status_code == 201, first.text
    api.app.scheduler.run_round()
    start(api, node_id, first.json()["tasks"][0]["id"])
    plain = post(api, admin, service_body(name="plain"), dry=True)
    assert plain.json()["dedup"]["reused"] is True  # the rule applies without volumes
    mine = post(api, admin, service_body(name="mine", task={"volumes": [LORA]}))
    assert mine.status_code == 201, mine.text
    assert mine.json()["dedup"] is None and mine.json()["id"] != first.json()["id"]
    assert mine.json()["tasks"][0]["volumes"] == [{**LORA, "read_only": True}]
