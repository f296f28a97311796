"""One container recipe: what the agent launches is what the dry run shows.

For every engine x shape, the plan the dry run shows for a group (``planned_recipe``, as
``POST /task-groups?dry_run=true`` builds it) is compared field by field with the plan
the agent builds (``build_container``) from the assignment a create + schedule of the
same group gives it. Only the ids a create assigns (task, group) and the agent's work
dir (config file sources) are masked: they are placeholders in the dry run by design.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container, task_shape
from heteroflow.agent.inventory import GpuCard
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.containers import HARDENED, ContainerPlan
from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.core.engines import ENGINES, CommandError
from heteroflow.core.placement import CardView, NodeView, Placement
from heteroflow.core.ports import (
    PortMapping,
    host_ports,
    ports_from_dicts,
    ports_to_dicts,
    with_host_ports,
)
from heteroflow.core.recipe import NodeShape, TaskShape, container_plan, image_tag_version
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.schemas.task_groups import TaskGroupCreate
from heteroflow.services.placement.dry_run import (
    PLANNED_CONFIG_DIR,
    PLANNED_GROUP_ID,
    PLANNED_ID,
    plan_read,
    planned_recipe,
)
from heteroflow.services.placement.planning import GroupPlan

NODE_ADDRESS = "10.0.0.7"  # the address the node reports and its agent publishes on
TASK_ID, GROUP_ID = "task-0123", "tg-4567"
POOL_START = 21000
VENDOR_PREFERENCE = ("nvidia", "ascend", "musa", "amd", "hygon")
VLLM_WITH_OFFLOAD = "vllm/vllm-openai:v0.11.2"


@dataclasses.dataclass(frozen=True)
class Shape:
    name: str
    parallelism: str = "single"
    world_size: int = 1
    gpu_required: int = 1  # per task (single/split); tensor_parallel takes world_size
    kv_offload_gb: int = 0
    command: tuple[str, ...] = ()

    @property
    def replicas(self) -> int:
        return self.world_size if self.parallelism == "split" else 1

    @property
    def gpus_per_task(self) -> int:
        return self.world_size if self.parallelism == "tensor_parallel" else self.gpu_required


SHAPES = (
    Shape("single"),
    Shape("split", parallelism="split", world_size=2),
    Shape("tp2", parallelism="tensor_parallel", world_size=2),
    Shape("tp4", parallelism="tensor_parallel", world_size=4),
    Shape("cpu", gpu_required=0),
    Shape("kv-offload", kv_offload_gb=8),
    Shape("custom-command", command=("python3", "serve.py", "--port", "8000")),
)


def applies(engine: str, shape: Shape) -> bool:
    spec = ENGINES[engine]
    if shape.parallelism not in spec.shapes:
        return False
    if shape.gpus_per_task == 0 and not spec.cpu_capable:
        return False
    return not (shape.kv_offload_gb and engine != "vllm")


PAIRS = [(engine, shape) for engine in ENGINES for shape in SHAPES if applies(engine, shape)]
CASES = [pytest.param(engine, shape, id=f"{engine}-{shape.name}") for engine, shape in PAIRS]


def vendor_of(engine: str) -> str:
    return next(v for v in VENDOR_PREFERENCE if v in ENGINES[engine].vendors)


def request(engine: str, shape: Shape, model: Path, image: str = "") -> TaskGroupCreate:
    if not image:
        # lower case: the request schema refuses upper-case tags (MindIE's default has them)
        image = VLLM_WITH_OFFLOAD if shape.kv_offload_gb else ENGINES[engine].default_image.lower()
    task: dict[str, Any] = {
        "image": image,
        "engine": engine,
        "gpu_required": shape.gpu_required,
        "model_path": str(model),
        # the agent drops its own names (C3) on both paths alike
        "env": ["HF_HOME=/cache", "BARE", "CUDA_VISIBLE_DEVICES=9", "NCCL_DEBUG=INFO"],
        "ports": [{"container_port": 8000}, {"container_port": 9090}],
        "kv_offload_gb": shape.kv_offload_gb,
        "command": list(shape.command),
        "engine_args": [] if engine == "mindie" or shape.command else ["--seed", "1"],
    }
    return TaskGroupCreate.model_validate(
        {
            "name": "svc",
            "model_name": "m-1",
            "parallelism": shape.parallelism,
            "world_size": shape.world_size,
            "gpu_memory_utilization": 80,
            "task": task,
        }
    )


def group_plan(engine: str, shape: Shape, model: Path, image: str = "") -> GroupPlan:
    req = request(engine, shape, model, image)
    return GroupPlan(
        req=req,
        engine=engine,
        engine_reason="explicit task.engine",
        task_type="inference",
        enable_api=True,
        model_name="m-1",
        ports=tuple(PortMapping(p.container_port, p.host_port) for p in req.task.ports),
        replicas=shape.replicas,
        gpus_per_task=shape.gpus_per_task,
        endpoint_name="svc",
        endpoint_port=8000,
        health={},
        memory_mb=0,
        estimated_gpu_memory_mb=0,
    )


def node_view(vendor: str, cards: int = 8) -> NodeView:
    return NodeView(
        id="node-1",
        name="node-1",
        online=True,
        cards=[CardView(i, vendor, "X", 65536) for i in range(cards)],
        cpu_count=16,
        memory_total_mb=262144,
    )


def placement(plan: GroupPlan, rank: int) -> Placement:
    g = plan.gpus_per_task
    n = len(plan.ports)
    return Placement(
        node_id="node-1",
        gpu_ids=tuple(range(rank * g, rank * g + g)),
        per_card_mb=0,
        memory_mb=0,
        host_ports=tuple(range(POOL_START + rank * n, POOL_START + rank * n + n)),
    )


def assignment(plan: GroupPlan, rank: int, where: Placement) -> TaskAssignment:
    """What a create + scheduler round write for this task, as the heartbeat carries it
    (the integration test gets it from the real server)."""
    spec = plan.req.task
    return TaskAssignment(
        id=TASK_ID,
        group_id=GROUP_ID,
        name=spec.name or f"{plan.req.name}-{rank}",
        status="starting",
        task_type=plan.task_type,
        model_name=plan.model_name,
        model_path=spec.model_path,
        image=spec.image,
        engine=plan.engine,
        command=list(spec.command),
        engine_args=list(spec.engine_args),
        env=list(spec.env),
        ports=ports_to_dicts(with_host_ports(plan.ports, where.host_ports)),
        gpu_ids=list(where.gpu_ids),
        gpu_required=plan.gpus_per_task,
        memory_mb=0,
        kv_offload_gb=spec.kv_offload_gb,
        generation=1,
        gpu_memory_utilization=plan.req.gpu_memory_utilization,
        parallelism=plan.req.parallelism,
        health_check={},
    )


def agent_cards(vendor: str, cards: int = 8) -> list[GpuCard]:
    return [
        GpuCard(i, f"uuid-{i}", vendor, "X", 65536, 0, None, False, False, None, "declared")
        for i in range(cards)
    ]


def masked(value: Any, work_dir: Path) -> Any:
    """The dry run's placeholders replaced by what a create + the agent fill in."""
    if isinstance(value, str):
        return (
            value.replace(PLANNED_CONFIG_DIR, str(work_dir / "config"))
            .replace(PLANNED_ID, TASK_ID)
            .replace(PLANNED_GROUP_ID, GROUP_ID)
        )
    if isinstance(value, dict):
        return {masked(k, work_dir): masked(v, work_dir) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(masked(v, work_dir) for v in value)
    return value


def as_dict(plan: ContainerPlan) -> dict[str, Any]:
    d = dataclasses.asdict(plan)
    d["env"], d["labels"], d["ports"] = dict(plan.env), dict(plan.labels), dict(plan.ports)
    if plan.gpu is not None:
        d["gpu"]["env"] = dict(plan.gpu.env)
    return d


@pytest.fixture
def model(tmp_path: Path) -> Path:
    d = tmp_path / "models" / "m"
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")
    return d


@pytest.fixture
def config(tmp_path: Path) -> NodeConfig:
    return NodeConfig.from_dict({"allowed_volume_prefixes": [str(tmp_path / "models")]})


@pytest.mark.parametrize(("engine", "shape"), CASES)
def test_the_agent_launches_what_the_dry_run_shows(
    engine: str, shape: Shape, model: Path, config: NodeConfig, tmp_path: Path
) -> None:
    plan = group_plan(engine, shape, model)
    vendor = vendor_of(engine)
    work_dir = tmp_path / "agent"
    for rank in range(plan.replicas):
        where = placement(plan, rank)
        shown = planned_recipe(plan, rank, where, node_view(vendor), NODE_ADDRESS)
        t = assignment(plan, rank, where)
        version = "0.11.2" if t.kv_offload_gb else ""  # the agent's probe of the image
        launched = build_container(
            t,
            config,
            address=NODE_ADDRESS,
            cards=agent_cards(vendor),
            work_dir=work_dir,
            engine_version=version,
        )
        want, got = masked(as_dict(shown.plan), work_dir), as_dict(launched)
        assert set(want) == {f.name for f in dataclasses.fields(ContainerPlan)}
        for name in want:
            assert want[name] == got[name], f"{engine} {shape.name} rank {rank}: {name}"
        # the config files the dry run lists are the ones the agent wrote, same content
        for f in shown.config_files:
            written = Path(masked(f.source, work_dir))
            assert written.read_text() == masked(f.content, work_dir)
        read = plan_read(shown)
        assert read.config_files == [f.target for f in shown.config_files]
        assert read.security == dataclasses.asdict(HARDENED)
        assert read.labels["heteroflow.engine"] == engine


def test_every_engine_is_compared() -> None:
    assert {engine for engine, _ in PAIRS} == set(ENGINES)
    assert {shape.name for _, shape in PAIRS} == {s.name for s in SHAPES}


def test_the_plan_publishes_on_the_nodes_address_with_labels_and_config_mounts(
    model: Path,
) -> None:
    """The engine's API port on the node's private loopback, behind the door that
    listens on the node's address at the same port (C14); any other port on the node's
    address."""
    plan = group_plan("mindie", Shape("tp2", parallelism="tensor_parallel", world_size=2), model)
    shown = planned_recipe(plan, 0, placement(plan, 0), node_view("ascend"), "10.1.2.3")
    c = shown.plan
    assert c.ports == {8000: (ENGINE_ADDRESS, POOL_START), 9090: ("10.1.2.3", POOL_START + 1)}
    assert c.labels["heteroflow.task"] == PLANNED_ID and c.labels["heteroflow.generation"] == "1"
    [cfg] = shown.config_files
    assert cfg.source == f"{PLANNED_CONFIG_DIR}/{PLANNED_ID}/{cfg.target.lstrip('/')}"
    assert any(m.target == cfg.target and m.read_only for m in c.mounts)
    assert c.security == HARDENED


def test_an_unplaced_task_shows_placeholders_for_the_node(model: Path) -> None:
    plan = group_plan("vllm", Shape("single"), model)
    shown = planned_recipe(plan, 0, None, None, None)
    assert {ip for ip, _ in shown.plan.ports.values()} == {"<node-address>"}
    assert [hp for _, hp in shown.plan.ports.values()] == [0, 0]  # from the pool, later
    assert shown.plan.gpu is None


def test_refusals_are_the_same_on_both_paths(
    model: Path, config: NodeConfig, tmp_path: Path
) -> None:
    # kv offload needs the image's vLLM version: the dry run reads the tag, the agent
    # its probe; without one both refuse with the builder's reason
    offload = Shape("kv-offload", kv_offload_gb=8)
    plan = group_plan("vllm", offload, model, image="vllm/vllm-openai:latest")
    where = placement(plan, 0)
    with pytest.raises(CommandError, match="engine_version"):
        planned_recipe(plan, 0, where, node_view("nvidia"), NODE_ADDRESS)
    with pytest.raises(LaunchFailed, match="engine_version"):
        build_container(
            assignment(plan, 0, where), config, address=NODE_ADDRESS,
            cards=agent_cards("nvidia"), work_dir=tmp_path / "agent",
        )


def test_no_engine_and_no_command_is_refused_by_the_recipe() -> None:
    task = TaskShape(id="t", group_id="g", name="n", image="busybox", engine="")
    with pytest.raises(CommandError, match="no engine"):
        container_plan(task, NodeShape("127.0.0.1"), work_dir_config="/w")


@pytest.mark.parametrize(
    ("image", "version"),
    [
        ("vllm/vllm-openai:v0.11.2", "0.11.2"),
        ("registry.local:5000/vllm:0.10.2", "0.10.2"),
        ("vllm/vllm-openai:v0.6.3.post1@sha256:" + "0" * 64, "0.6.3.post1"),
        ("vllm/vllm-openai:latest", ""),
        ("registry.local:5000/vllm", ""),
        ("vllm", ""),
    ],
)
def test_image_tag_version(image: str, version: str) -> None:
    assert image_tag_version(image) == version


def test_port_mapping_keeps_the_wire_form() -> None:
    wire = [{"container_port": 8000, "host_port": 21000}, {"container_port": 9090}]
    ports = ports_from_dicts(wire)
    assert ports == (PortMapping(8000, 21000), PortMapping(9090, 0))
    assert ports_to_dicts(ports) == [
        {"container_port": 8000, "host_port": 21000},
        {"container_port": 9090, "host_port": 0},
    ]
    assert host_ports(ports) == (21000, 0) and host_ports(ports, chosen_only=True) == (21000,)
    # a fixed port stays; the pool's choice fills the other and is marked as the pool's
    placed = with_host_ports(ports, (21000, 2))
    assert placed == (PortMapping(8000, 21000), PortMapping(9090, 2, from_pool=True))
    assert ports_to_dicts(placed)[1] == {"container_port": 9090, "host_port": 2, "from_pool": True}
    assert ports_from_dicts(ports_to_dicts(placed)) == placed
    # given back: only the pool's port returns to the pool (P2); a fixed one stays
    assert [p.released() for p in placed] == [PortMapping(8000, 21000), PortMapping(9090, 0)]
    with pytest.raises(ValueError):
        with_host_ports(ports, (1,))


def test_the_agent_reads_the_assignment_through_the_same_type() -> None:
    t = TaskAssignment(
        id="t", group_id="g", name="n", status="starting", task_type="inference",
        model_name="m", model_path="m", image="i", engine="vllm", command=[],
        engine_args=[], env=[], ports=[{"container_port": 8000, "host_port": 21001}],
        gpu_ids=[0], gpu_required=1, memory_mb=0, health_check={},
    )
    assert task_shape(t).ports == (PortMapping(8000, 21001),)
