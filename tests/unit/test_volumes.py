"""A task's volumes and preemptible flag (A2): the rules (core.volumes, on core.paths' one
allow-list rule), the recipe's mounts, the scheduler's node gate and preemption, and the
agent's own checks before a launch (C4's line on the node)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container
from heteroflow.agent.launch import build_launch
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.containers import Mount
from heteroflow.core.paths import VolumeRule, task_roots
from heteroflow.core.placement import (
    NodeView,
    Policy,
    Reservation,
    TaskDemand,
    place,
    plan_preemption,
)
from heteroflow.core.placement import filters as f
from heteroflow.core.placement.reasons import explain
from heteroflow.core.recipe import NodeShape, TaskShape, container_plan
from heteroflow.core.volumes import (
    MAX_VOLUMES,
    SYSTEM_PATHS,
    Volume,
    reserved_targets,
    volumes_refusal,
)
from heteroflow.schemas.nodes import TaskAssignment

from .test_placement_sharing import demand, node, put

RULES = [VolumeRule(("/models", "/srv/cache"), ("/models/secret",))]
pytestmark = pytest.mark.feature("A2")


def refusal(*volumes: Volume, model_path: str = "/models/m.gguf",
            engine: str = "llamacpp") -> tuple[str, str] | None:
    return volumes_refusal(list(volumes), model_path=model_path, engine=engine, rules=RULES)


def test_a_volume_inside_the_allow_list_on_a_free_path_passes() -> None:
    assert refusal(Volume("/models/loras", "/mnt/loras"),
                   Volume("/srv/cache/hub", "/root/.cache/huggingface", read_only=False)) is None
    assert Volume.of({"host_path": "/a", "container_path": "/b"}).read_only is True


@pytest.mark.parametrize(
    ("volume", "field", "words"),
    [
        (Volume("/etc", "/mnt/x"), "host_path", "outside the allowed volume prefixes"),
        (Volume("/models2/x", "/mnt/x"), "host_path", "outside"),  # segment boundary
        (Volume("/models/secret/k", "/mnt/k"), "host_path", "denied volume prefix"),
        (Volume("loras", "/mnt/x"), "host_path", "absolute path on the node"),
        (Volume("/models/a/../../etc", "/mnt/x"), "host_path", "'..' segment"),
        (Volume("/models/a\n", "/mnt/x"), "host_path", "control character"),
        (Volume("https://x/y", "/mnt/x"), "host_path", "URL"),
        (Volume("/models/a", "mnt"), "container_path", "absolute path in the container"),
        (Volume("/models/a", "/"), "container_path", "whole image"),
        (Volume("/models/a", "//etc/"), "container_path", "system path"),
        (Volume("/models/a", "/proc/self"), "container_path", "system path"),
        (Volume("/models/a", "/var/run/docker.sock"), "container_path", "system path"),
        (Volume("/models/a", "/models"), "container_path", "the platform mounts"),
        (Volume("/models/a", "/models/m.gguf/x"), "container_path", "the platform mounts"),
        (Volume("/models/a", "/heteroflow"), "container_path", "the platform mounts"),
        (Volume("/models/a", "/mnt/../etc"), "container_path", "'..' segment"),
    ],
)
def test_each_rule_refuses_naming_the_field(volume: Volume, field: str, words: str) -> None:
    got = refusal(Volume("/models/ok", "/mnt/ok"), volume)
    assert got is not None
    message, where = got
    assert where == f"task.volumes[1].{field}" and words in message, got
    assert message.startswith(f"task.volumes[1].{field}")


def test_system_paths_cover_what_an_image_runs_on_and_leave_the_usual_homes_free() -> None:
    for path in ("/etc/passwd", "/usr/lib/python3", "/lib64", "/dev/shm", "/sys/fs"):
        assert refusal(Volume("/models/a", path)) is not None, path
    for path in ("/tmp/x", "/root/.cache", "/opt/lora", "/mnt/a", "/data/cache", "/var/cache"):
        assert refusal(Volume("/models/a", path)) is None, path
    assert "/proc" in SYSTEM_PATHS


def test_duplicates_and_too_many_are_refused() -> None:
    got = refusal(Volume("/models/a", "/mnt/a"), Volume("/models/b", "/mnt/a/"))
    assert got is not None and got[1] == "task.volumes[1].container_path" and "volume 0" in got[0]
    many = [Volume("/models/a", f"/mnt/{i}") for i in range(MAX_VOLUMES + 1)]
    assert refusal(*many) == (f"at most {MAX_VOLUMES} volumes", "task.volumes")


def test_the_reserved_paths_follow_the_model_mount() -> None:
    assert reserved_targets("tiny.gguf", "llamacpp") == ("/data/models/tiny.gguf", "/heteroflow")
    assert reserved_targets("/srv/engine", "trtllm") == ("/srv/engine", "/heteroflow")
    assert reserved_targets("", "") == ("/heteroflow",)


def test_the_agent_scope_names_its_own_rule() -> None:
    got = volumes_refusal([Volume("/etc", "/mnt/x")], model_path="", engine="",
                          rules=RULES, scope="of this node")
    assert got is not None and "of this node" in got[0]


def test_the_recipe_mounts_them_read_only_unless_asked() -> None:
    task = TaskShape(
        id="task-1", group_id="tg-1", name="n", image="img", engine="llamacpp",
        model_path="/models/m.gguf", model_name="m",
        volumes=(Volume("/models/loras", "/mnt/loras"),
                 Volume("/srv/cache", "/root/.cache", read_only=False)),
    )
    plan = container_plan(task, NodeShape(address="127.0.0.1"), work_dir_config="/w").plan
    assert plan.mounts == (
        Mount("/models/m.gguf", "/models/m.gguf", True),
        Mount("/models/loras", "/mnt/loras", True),
        Mount("/srv/cache", "/root/.cache", False),
    )
    # the agent's assignment and a row hold dicts: the one constructor makes Volumes
    shaped = TaskShape.of(
        type("Row", (), {"id": "t", "group_id": "g", "name": "n", "image": "i", "engine": "",
                         "volumes": [{"host_path": "/a", "container_path": "/b",
                                      "read_only": False}]})()
    )
    assert shaped.volumes == (Volume("/a", "/b", read_only=False),)


def test_a_containers_volumes_are_roots_for_file_requests_the_process_runtime_has_none() -> None:
    assert task_roots("tiny.gguf", "llamacpp", "docker", ["/models/loras/"]) == [
        "/data/models/tiny.gguf", "/models/loras"]
    assert task_roots("", "", "docker", ["/srv/x"]) == ["/srv/x"]
    assert task_roots("/m/a.gguf", "llamacpp", "process", ["/srv/x"]) == ["/m"]


# --- the scheduler --------------------------------------------------------------------------


def test_the_node_gate_holds_each_host_path_to_the_nodes_rule_and_needs_a_mount() -> None:
    t = demand("t", gpu_required=0, task_type="inference", host_paths=("/models/loras",))
    ok = node("ok", 0, allowed_volume_prefixes=("/models",))
    narrow = node("narrow", 0, allowed_volume_prefixes=("/data/models",))
    proc = node("proc", 0, allowed_volume_prefixes=("/models",), runtime="process")
    assert f.node_gate(ok, t, 90.0, 8) == ""
    assert f.node_gate(narrow, t, 90.0, 8) == f.HOST_VOLUME
    assert f.node_gate(proc, t, 90.0, 8) == f.NO_MOUNTS
    counts = {f.HOST_VOLUME: 1, f.NO_MOUNTS: 1}
    said = explain(t, 2, counts, 90.0, 8)
    assert "task.volumes host path outside" in said and "mounts nothing" in said
    placed = place(t, [narrow, proc, ok], Reservation(), range(20000, 20010))
    assert getattr(placed, "node_id", None) == "ok"


@pytest.mark.feature("A2", "B4")
def test_preemption_never_picks_a_task_that_is_not_preemptible() -> None:
    a = node("a")
    put(a, demand("keep", task_type="training", priority=1, preemptible=False))
    want = demand("urgent", task_type="training", priority=100)
    assert plan_preemption(want, [a], Reservation(), range(20000, 20010), Policy()) is None
    b = node("b")
    put(b, demand("low", task_type="training", priority=50))
    plan = plan_preemption(want, [a, b], Reservation(), range(20000, 20010), Policy())
    assert plan is not None and [v.task_id for v in plan.victims] == ["low"]
    assert a.occupants[0].preemptible is False and b.occupants[0].preemptible is True


# --- the agent ------------------------------------------------------------------------------


def assignment(volumes: list[dict[str, Any]], model: Path, **over: Any) -> TaskAssignment:
    base: dict[str, Any] = dict(
        id="task-1", group_id="tg-1", name="n", status="starting", task_type="inference",
        model_name="m", model_path=str(model), image="ghcr.io/ggml-org/llama.cpp:server",
        engine="llamacpp", command=[], engine_args=[], env=[],
        ports=[{"container_port": 8000, "host_port": 30001}], gpu_ids=[], gpu_required=0,
        memory_mb=0, health_check={}, volumes=volumes,
    )
    base.update(over)
    return TaskAssignment(**base)


@pytest.fixture
def allowed(tmp_path: Path) -> Path:
    root = tmp_path / "allowed"
    (root / "loras").mkdir(parents=True)
    (root / "m.gguf").write_bytes(b"GGUF")
    return root


def build(t: TaskAssignment, root: Path, tmp_path: Path) -> Any:
    config = NodeConfig(allowed_volume_prefixes=(str(root),))
    return build_container(t, config, address="127.0.0.1", cards=[], work_dir=tmp_path / "w")


@pytest.mark.feature("A2", "C4")
def test_the_agent_checks_again_on_real_paths_before_it_launches(
    allowed: Path, tmp_path: Path
) -> None:
    model = allowed / "m.gguf"
    v = {"host_path": str(allowed / "loras"), "container_path": "/mnt/loras"}
    plan = build(assignment([v], model), allowed, tmp_path)
    assert Mount(str(allowed / "loras"), "/mnt/loras", True) in plan.mounts
    # its own allow-list: a path the server's nodes allowed but this node does not
    with pytest.raises(LaunchFailed, match=r"task.volumes\[0\].host_path .* of this node"):
        build(assignment([{**v, "host_path": "/srv/other"}], model), allowed, tmp_path)
    # a symlink inside the allow-list that leads out of it
    outside = tmp_path / "outside"
    outside.mkdir()
    (allowed / "escape").symlink_to(outside)
    with pytest.raises(LaunchFailed, match=r"task.volumes\[0\].host_path .* outside this node"):
        build(assignment([{**v, "host_path": str(allowed / "escape")}], model), allowed,
              tmp_path)
    with pytest.raises(LaunchFailed, match="does not exist on this node"):
        build(assignment([{**v, "host_path": str(allowed / "gone")}], model), allowed, tmp_path)
    # a row written before a rule existed: the container side is checked here too
    with pytest.raises(LaunchFailed, match="system path"):
        build(assignment([{**v, "container_path": "/etc"}], model), allowed, tmp_path)


def test_the_process_runtime_refuses_a_task_with_volumes(allowed: Path, tmp_path: Path) -> None:
    t = assignment([{"host_path": str(allowed / "loras"), "container_path": "/mnt/l"}],
                   allowed / "m.gguf")
    config = NodeConfig(allowed_volume_prefixes=(str(allowed),))
    with pytest.raises(LaunchFailed, match="mounts nothing"):
        build_launch(t, config, cpu_threads=1, log_dir=tmp_path)


def test_a_node_view_without_volumes_is_unchanged() -> None:
    """No volumes: the gate says what it said before (the model path's rule only)."""
    t: TaskDemand = demand("t", gpu_required=0, task_type="inference")
    n: NodeView = node("n", 0, runtime="process")
    assert f.node_gate(n, t, 90.0, 8) == ""
