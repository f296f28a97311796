"""Sleep and wake on a real Docker Engine (F1, F2, F3, C2).

The runtime: ``halt`` stops a container and keeps it, ``resume`` starts that same
container again (same id, same published port, answering), and a container removed
meanwhile is ``ContainerGone``. End to end (server + agent processes, the llama.cpp
engine image): sleep stops the service's container and keeps it through many agent
heartbeats (no zombie cleanup), wake starts the same container id again and the OpenAI
SDK gets an answer through the gateway; a container removed while asleep fails the task
at wake with ``fault.container_lost``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.agent.runtime.protocol import ContainerGone
from tests.conftest import free_port
from tests.docker.conftest import make_plan, wait_until
from tests.docker.test_agent_on_docker import body, create, dstack  # noqa: F401 (a fixture)
from tests.e2e.conftest import Stack, wait_for

HTTPD = ("sh", "-c", "mkdir -p /w && echo awake > /w/index.html && httpd -f -p 8000 -h /w")


def fetch(port: int) -> str:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/index.html", timeout=1).text
    except httpx.HTTPError:
        return ""


@pytest.mark.feature("F1", "F2", "C2")
def test_halt_keeps_the_container_and_resume_starts_the_same_one(
    runtime: DockerRuntime, busybox_image: str
) -> None:
    port = free_port()
    plan = make_plan(busybox_image, HTTPD, ports={8000: ("127.0.0.1", port)})
    runtime.start(plan)
    first = runtime.inspect(plan.name)["Id"]
    assert "awake" in wait_until(lambda: fetch(port), 10, "httpd")

    runtime.halt(plan.name, 5)
    assert runtime.managed()[plan.name] == "exited"  # kept, listed, not running
    assert runtime.exit_code(plan.name) is not None and fetch(port) == ""

    runtime.resume(plan.name)
    assert runtime.inspect(plan.name)["Id"] == first
    assert runtime.exit_code(plan.name) is None
    assert "awake" in wait_until(lambda: fetch(port), 10, "httpd after the wake")
    runtime.resume(plan.name)  # starting a running container again is harmless

    runtime.halt(plan.name, 5)
    runtime.remove(plan.name)
    with pytest.raises(ContainerGone, match="gone at wake"):
        runtime.resume(plan.name)


def _answers(client: openai.OpenAI, model: str) -> bool:
    try:
        out = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        return bool(out.choices[0].message.content)
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 502, 503):
            return False
        raise
    except openai.APIConnectionError:
        return False


def _state(client: Any, task_id: str) -> tuple[str, str]:
    c = client.containers.get(task_id)
    return str(c.id), str(c.status)


def _task(st: Stack, task_id: str) -> dict[str, Any]:
    return dict(st.api("GET", f"/api/v1/tasks/{task_id}").json())


@pytest.mark.feature("F1", "F2", "C2", "C8")
def test_a_service_sleeps_in_its_kept_container_and_wakes_in_the_same_one(
    dstack: Stack, docker_client: Any  # noqa: F811
) -> None:
    g = create(dstack, body("napper"))
    key = g["api_key"]
    g = dstack.wait_status(g["id"], "running", 60)
    task_id = g["tasks"][0]["id"]
    container_id, status = _state(docker_client, task_id)
    assert status == "running"
    client = openai.OpenAI(
        base_url=dstack.server_url + "/v1", api_key=key, max_retries=0, timeout=30
    )
    wait_for(lambda: _answers(client, "napper-model"), 15, "an answer before the sleep")

    r = dstack.api("POST", f"/api/v1/tasks/{task_id}/sleep")
    assert r.status_code == 202 and r.json()["status"] == "sleeping"
    start = time.monotonic()
    wait_for(lambda: _state(docker_client, task_id)[1] == "exited", 20, "container stopped")
    stopped_s = time.monotonic() - start
    time.sleep(2)  # several agent heartbeats: neither removed as a zombie nor "lost"
    assert _state(docker_client, task_id) == (container_id, "exited")
    assert _task(dstack, task_id)["status"] == "sleeping"
    assert dstack.group(g["id"])["status"] == "sleeping"

    r = dstack.api("POST", f"/api/v1/tasks/{task_id}/wake")
    assert r.status_code == 202 and r.json()["branch"] == "waking"
    start = time.monotonic()
    dstack.wait_status(g["id"], "running", 60)
    assert _state(docker_client, task_id) == (container_id, "running")  # the same one
    wait_for(lambda: _answers(client, "napper-model"), 15, "an answer after the wake")
    woke_s = time.monotonic() - start
    print(f"docker: sleep -> container stopped {stopped_s:.2f} s; wake -> answer {woke_s:.2f} s")
    assert "awake" in _task(dstack, task_id)["status_message"]

    # stopped while asleep: the container kept for the wake goes too
    dstack.api("POST", f"/api/v1/tasks/{task_id}/sleep")
    wait_for(lambda: _state(docker_client, task_id)[1] == "exited", 20, "container stopped")
    assert dstack.api("POST", f"/api/v1/tasks/{task_id}/stop").status_code == 200

    def removed() -> bool:
        try:
            docker_client.containers.get(task_id)
        except Exception:
            return True
        return False

    wait_for(removed, 20, "the kept container removed")
    assert _task(dstack, task_id)["status"] == "stopped"


@pytest.mark.feature("F3", "C2")
def test_a_container_removed_while_asleep_fails_the_task_at_wake(
    dstack: Stack, docker_client: Any  # noqa: F811
) -> None:
    g = create(dstack, body("gone"))
    g = dstack.wait_status(g["id"], "running", 60)
    task_id = g["tasks"][0]["id"]
    dstack.api("POST", f"/api/v1/tasks/{task_id}/sleep")
    wait_for(lambda: _state(docker_client, task_id)[1] == "exited", 20, "container stopped")
    docker_client.containers.get(task_id).remove(force=True)
    assert dstack.api("POST", f"/api/v1/tasks/{task_id}/wake").json()["branch"] == "waking"
    wait_for(lambda: _task(dstack, task_id)["status"] == "failed", 20, "task failed")
    assert _task(dstack, task_id)["status_message"] == "container gone at wake"
    w = dstack.api("POST", f"/api/v1/tasks/{task_id}/wake").json()
    assert w["branch"] == "container_gone", w
    events = dstack.api("GET", f"/api/v1/task-groups/{g['id']}/events").json()
    assert any(e["kind"] == "fault.container_lost" for e in events)
