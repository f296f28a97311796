"""A task's volumes in a real container (A2): the agent's own recipe and checks
(``build_container``) mount a host folder read-only unless the task asks otherwise, and a
write to the read-only one fails while the read-write one takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container
from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.schemas.nodes import TaskAssignment

from .conftest import new_task_id, wait_until

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
