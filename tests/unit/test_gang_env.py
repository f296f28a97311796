"""A gang's distributed environment (G1, C1; core/gang.py): each stage of a ``pipeline``
group finds its peers from the variables the platform gives it, and the dry run shows
exactly what the agent launches (containers and processes alike).

The property test places a gang at random (stages on a few nodes, cards, pool ports),
builds each stage's plan the way the dry run does (``planned_recipe``/``planned_gang``)
and the way the agent does from the assignment a create + scheduler round + claim give it
(``build_container`` / ``task_env`` of a ``TaskAssignment`` with its ``gang``), and holds
them equal field by field.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container
from heteroflow.agent.inventory import GpuCard
from heteroflow.agent.launch import task_env
from heteroflow.core.containers import AGENT_OWNED_ENV, container_env
from heteroflow.core.gang import (
    GANG_ENV,
    RENDEZVOUS,
    GangPlace,
    Stage,
    gang_env,
    gang_places,
    rendezvous_port,
    stage_ports,
)
from heteroflow.core.placement import CardView, NodeView, Placement
from heteroflow.core.ports import PortMapping, ports_to_dicts, with_host_ports
from heteroflow.core.process_recipe import process_env
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.schemas.task_groups import TaskGroupCreate
from heteroflow.services.placement.dry_run import (
    PLANNED_GROUP_ID,
    PLANNED_ID,
    UNPLACED_ADDRESS,
    _task_shape,
    planned_gang,
    planned_recipe,
)
from heteroflow.services.placement.placer import Outcome
from heteroflow.services.placement.planning import GroupPlan

TASK_ID, GROUP_ID = "task-0123", "tg-4567"
COMMAND = ("python3", "train.py")


def gang_plan(world_size: int, gpus: int, container_ports: tuple[int, ...]) -> GroupPlan:
    req = TaskGroupCreate.model_validate(
        {
            "name": "gang",
            "task_type": "container",
            "parallelism": "pipeline",
            "world_size": world_size,
            "task": {
                "image": "pytorch/pytorch:2.5.1",
                "command": list(COMMAND),
                "gpu_required": gpus,
                # a user's own values of the agent's names are dropped (C3)
                "env": ["MASTER_ADDR=evil", "RANK=9", "NCCL_DEBUG=INFO"],
                "ports": [{"container_port": p} for p in container_ports],
            },
        }
    )
    return GroupPlan(
        req=req, engine="", engine_reason="", task_type="container", enable_api=False,
        model_name="gang", ports=tuple(PortMapping(p) for p in container_ports),
        replicas=world_size, gpus_per_task=gpus, endpoint_name="gang",
        endpoint_port=container_ports[0], health={}, memory_mb=0, estimated_gpu_memory_mb=0,
    )


def node(i: int, cards: int) -> NodeView:
    return NodeView(
        id=f"node-{i}", name=f"node-{i}", online=True, address=f"10.0.0.{i + 1}",
        cards=[CardView(c, "nvidia", "X", 65536) for c in range(cards)],
        cpu_count=16, memory_total_mb=262144,
    )


def assignment(plan: GroupPlan, rank: int, where: Placement, gang: GangPlace) -> TaskAssignment:
    """What a create writes (``plan.task_ports``), a round books (``with_host_ports``)
    and the claim hands over (``gang``), as the agent receives it."""
    spec = plan.req.task
    return TaskAssignment.model_validate(
        {
            "id": TASK_ID, "group_id": GROUP_ID, "name": f"{plan.req.name}-{rank}",
            "status": "starting", "task_type": plan.task_type, "model_name": plan.model_name,
            "model_path": "", "image": spec.image, "engine": "", "command": list(spec.command),
            "engine_args": [], "env": list(spec.env),
            "ports": ports_to_dicts(with_host_ports(plan.task_ports(rank), where.host_ports)),
            "gpu_ids": list(where.gpu_ids), "gpu_required": plan.gpus_per_task,
            "memory_mb": 0, "parallelism": "pipeline", "health_check": {},
            "gpu_memory_utilization": plan.req.gpu_memory_utilization,
            # the wire's JSON, as the claim reply carries it
            "gang": gang.to_dict(),
        }
    )


def masked(value: Any) -> Any:
    if isinstance(value, str):
        return value.replace(PLANNED_ID, TASK_ID).replace(PLANNED_GROUP_ID, GROUP_ID)
    if isinstance(value, dict):
        return {masked(k): masked(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(masked(v) for v in value)
    return value


def as_dict(plan: Any) -> dict[str, Any]:
    d = dataclasses.asdict(plan)
    d["env"], d["labels"], d["ports"] = dict(plan.env), dict(plan.labels), dict(plan.ports)
    if plan.gpu is not None:
        d["gpu"]["env"] = dict(plan.gpu.env)
    return d


@st.composite
def placed_gangs(draw: st.DrawFn) -> tuple[GroupPlan, list[NodeView], list[Outcome]]:
    world = draw(st.integers(2, 5))
    gpus = draw(st.integers(0, 2))
    cports = tuple(draw(st.lists(st.integers(1, 65535), min_size=1, max_size=3, unique=True)))
    plan = gang_plan(world, gpus, cports)
    nodes = [node(i, cards=gpus * world) for i in range(draw(st.integers(1, 3)))]
    taken: dict[str, int] = {}
    outcomes = []
    for rank in range(world):
        n = nodes[draw(st.integers(0, len(nodes) - 1))]
        used = taken.get(n.id, 0)
        wanted = len(plan.task_ports(rank))
        hp = tuple(range(20000 + used, 20000 + used + wanted))
        taken[n.id] = used + wanted
        first = draw(st.integers(0, gpus * (world - 1)))
        where = Placement(n.id, tuple(range(first, first + gpus)), 0, 0, hp)
        outcomes.append(Outcome(where, n))
    return plan, nodes, outcomes


@pytest.mark.feature("G1")
@pytest.mark.feature("C1")
@pytest.mark.feature("G3")
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(placed_gangs())
def test_the_dry_runs_stage_env_is_what_the_agent_launches(
    tmp_path: Path, gang: tuple[GroupPlan, list[NodeView], list[Outcome]]
) -> None:
    plan, _nodes, outcomes = gang
    places = planned_gang(plan, outcomes)
    config = NodeConfig.from_dict({})
    cards = [GpuCard(i, f"u-{i}", "nvidia", "X", 65536, 0, None, False, False, None, "declared")
             for i in range(16)]
    master = outcomes[0]
    assert master.node is not None and master.placement is not None
    for rank, o in enumerate(outcomes):
        assert o.node is not None and o.placement is not None
        place = places[rank]
        assert place is not None
        # the claim's side: the same pure function over the rows a round writes
        rows = [
            Stage(r, x.node.address, with_host_ports(plan.task_ports(r), x.placement.host_ports))
            for r, x in enumerate(outcomes)
            if x.node is not None and x.placement is not None
        ]
        claimed = gang_places(rows)[rank]
        assert claimed == place
        t = assignment(plan, rank, o.placement, claimed)
        shown = planned_recipe(plan, rank, o.placement, o.node, o.node.address, gang=place)
        launched = build_container(
            t, config, address=o.node.address, cards=cards, work_dir=tmp_path / "agent"
        )
        want, got = masked(as_dict(shown.plan)), as_dict(launched)
        for name in want:
            assert want[name] == got[name], f"rank {rank}: {name}"
        env = got["env"]
        assert env["MASTER_ADDR"] == master.node.address
        assert env["MASTER_PORT"] == str(master.placement.host_ports[-1])
        assert (env["RANK"], env["WORLD_SIZE"]) == (str(rank), str(len(outcomes)))
        assert env["LOCAL_RANK"] == "0" and env["NODE_RANK"] == str(rank)
        assert env["HETEROFLOW_STAGE_GPU_IDS"] == ",".join(map(str, o.placement.gpu_ids))
        assert env["HETEROFLOW_STAGE_PORT"] == str(o.placement.host_ports[0])
        assert env["NCCL_DEBUG"] == "INFO"
        # the process runtime's environment carries the same gang variables
        proc_shown = process_env(_task_shape(plan, rank, o.placement, "", place))
        proc_launched = task_env(t)
        assert masked(proc_shown) == proc_launched
        assert {k: proc_launched[k] for k in GANG_ENV} == {k: env[k] for k in GANG_ENV}
        # nothing is published for the rendezvous: the stage binds it on the host network
        assert 0 not in launched.ports and launched.network_mode == "host"


@pytest.mark.feature("G1")
def test_rank_0_books_the_rendezvous_and_the_others_do_not() -> None:
    ports = (PortMapping(8000), PortMapping(9090))
    assert stage_ports(ports, 0) == (*ports, RENDEZVOUS)
    assert stage_ports(ports, 1) == ports
    plan = gang_plan(3, 1, (8000,))
    assert [len(plan.task_ports(r)) for r in range(3)] == [2, 1, 1]
    assert plan.demand(rank=0).host_ports == (0, 0)  # both from the pool
    assert plan.demand(rank=2).host_ports == (0,)
    booked = with_host_ports(plan.task_ports(0), (21000, 21001))
    assert rendezvous_port(booked) == 21001
    # given back to the pool with the task's other ports, and booked again next time
    assert rendezvous_port(tuple(p.released() for p in booked)) == 0


@pytest.mark.feature("C1")
@pytest.mark.feature("G3")
def test_gang_places_name_rank_0s_node_and_port() -> None:
    stages = [
        Stage(1, "10.0.0.2", (PortMapping(8000, 21000, True),)),
        Stage(0, "10.0.0.1", (PortMapping(8000, 21000, True), PortMapping(0, 21001, True))),
    ]
    assert gang_places(stages) == [
        GangPlace(1, 2, "10.0.0.1", 21001), GangPlace(0, 2, "10.0.0.1", 21001)
    ]


@pytest.mark.parametrize("ranks", [[1, 2], [0, 0], [0, 2]])
def test_a_gang_that_is_not_whole_has_no_places(ranks: list[int]) -> None:
    with pytest.raises(ValueError, match="ranks 0-1"):
        gang_places([Stage(r, "a", ()) for r in ranks])


@pytest.mark.feature("C1")
@pytest.mark.feature("G3")
def test_the_env_names_are_the_launchers_and_the_agents_own() -> None:
    env = gang_env(GangPlace(2, 4, "10.0.0.1", 21001), (3, 5), (PortMapping(8000, 21007),))
    assert env == {
        "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "21001", "RANK": "2", "WORLD_SIZE": "4",
        "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "2", "GROUP_RANK": "2",
        "HETEROFLOW_STAGE_GPU_IDS": "3,5", "HETEROFLOW_STAGE_PORT": "21007",
    }
    assert set(env) == GANG_ENV and GANG_ENV <= AGENT_OWNED_ENV
    assert gang_env(None, (0,)) == {}
    # a user's value of a gang name never reaches the stage (C3); the agent's does
    merged = container_env(
        ["RANK=7", "MASTER_PORT=1"], task_id="t", group_id="g", task_name="n", engine="",
        engine_env={}, gpu=None, gang=env,
    )
    assert merged["RANK"] == "2" and merged["MASTER_PORT"] == "21001"
    alone = container_env(
        ["RANK=7"], task_id="t", group_id="g", task_name="n", engine="", engine_env={},
        gpu=None,
    )
    assert "RANK" not in alone


def test_the_wire_dict_round_trips() -> None:
    place = GangPlace(1, 2, "10.0.0.1", 21001)
    assert GangPlace.of(place.to_dict()) == place
    assert GangPlace.of(None) is None


def test_an_unplaced_gang_shows_placeholders_and_a_single_group_none() -> None:
    plan = gang_plan(2, 1, (8000,))
    unplaced = [Outcome(None, None, None, "no node"), Outcome(None, None, None, "no node")]
    assert planned_gang(plan, unplaced) == [
        GangPlace(0, 2, UNPLACED_ADDRESS, 0), GangPlace(1, 2, UNPLACED_ADDRESS, 0)
    ]
    single = dataclasses.replace(plan, req=plan.req.model_copy(update={"parallelism": "split"}))
    assert planned_gang(single, unplaced) == [None, None]
