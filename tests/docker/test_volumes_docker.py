"""A task's volumes in a real container (A2): the agent's own recipe and checks
(``build_container``) mount a host folder read-only unless the task asks otherwise, and a
write to the read-only one fails while the read-write one takes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container
from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.schemas.nodes import TaskAssignment
from tests.e2e.conftest import Stack
from tests.e2e.conftest import wait_for as dstack_wait

from .conftest import new_task_id, wait_until
from .test_agent_on_docker import dstack  # noqa: F401 - a fixture: a server and a Docker agent

SCRIPT = (
    "cat /mnt/ro/f"
    " && if echo changed > /mnt/ro/f; then exit 7; fi"
    " && echo written > /mnt/rw/out"
)


@pytest.mark.feature("A2")
def test_a_volume_is_read_only_unless_asked_and_read_write_when_asked(
    runtime: DockerRuntime, busybox_image: str, tmp_path: Path
) -> None:
    ro, rw = tmp_path / "ro", tmp_path / "rw"
    ro.mkdir()
    rw.mkdir()
    rw.chmod(0o777)  # the container's user writes here, whoever it is
    (ro / "f").write_text("original")
    t = TaskAssignment(
        id=new_task_id(), group_id="tg-vol", name="vol", status="starting",
        task_type="container", model_name="", model_path="", image=busybox_image,
        engine="", command=["sh", "-c", SCRIPT], engine_args=[], env=[], ports=[],
        gpu_ids=[], gpu_required=0, memory_mb=0, health_check={},
        volumes=[
            {"host_path": str(ro), "container_path": "/mnt/ro"},
            {"host_path": str(rw), "container_path": "/mnt/rw", "read_only": False},
        ],
    )
    config = NodeConfig(allowed_volume_prefixes=(str(tmp_path),))
    plan = build_container(t, config, address="127.0.0.1", cards=[], work_dir=tmp_path / "w")
    runtime.start(plan)
    code = wait_until(lambda: runtime.exit_code(plan.name) is not None, 20, "the script to end")
    assert code and runtime.exit_code(plan.name) == 0, runtime.log_tail(plan.name, 10)
    logs = runtime.log_tail(plan.name, 10)
    assert "original" in logs and "Read-only file system" in logs, logs
    assert (ro / "f").read_text() == "original"
    assert (rw / "out").read_text() == "written\n"
    mounts = sorted((m["Destination"], m["RW"]) for m in runtime.inspect(plan.name)["Mounts"])
    assert mounts == [("/mnt/ro", False), ("/mnt/rw", True)]


@pytest.mark.feature("A2")
def test_volumes_through_the_whole_path_create_schedule_agent_container(
    dstack: Stack, busybox_image: str  # noqa: F811
) -> None:
    """The API's create to the agent's container on a real Docker Engine: the read-only
    volume refuses a write, the read-write one takes it, and the task completes."""
    ro, rw = dstack.models_dir / "ro", dstack.models_dir / "rw"
    ro.mkdir()
    rw.mkdir()
    rw.chmod(0o777)
    (ro / "f").write_text("original")
    r = dstack.api("POST", "/api/v1/task-groups", json={
        "name": "vols",
        "task_type": "container",
        "task": {
            "image": busybox_image, "gpu_required": 0, "command": ["sh", "-c", SCRIPT],
            "volumes": [
                {"host_path": str(ro), "container_path": "/mnt/ro"},
                {"host_path": str(rw), "container_path": "/mnt/rw", "read_only": False},
            ],
        },
    })
    assert r.status_code == 201, r.text
    task_id = r.json()["tasks"][0]["id"]

    def ended() -> dict[str, Any] | None:
        t = dstack.api("GET", f"/api/v1/tasks/{task_id}").json()
        return t if t["status"] in ("completed", "failed") else None

    t = dstack_wait(ended, 60, "the container task to end")
    assert t["status"] == "completed", t
    assert (ro / "f").read_text() == "original"
    assert (rw / "out").read_text() == "written\n"
