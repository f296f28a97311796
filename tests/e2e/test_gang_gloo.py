"""A real gang (G1, C1): two stages of a ``pipeline`` group, each started by the agent's
process runtime, all-reduce a tensor with ``torch.distributed`` (gloo) — each rank finds
its peer only from the environment the platform gave it (``env://``).

The stages' placement is the one a round writes (both on this machine, rank 0 with its
booked rendezvous port), the places the claim hands over (``core.gang.gang_places``), the
environment the agent's own function builds from the assignment (``agent.launch.task_env``);
the program is a stage's own command, run on the Python of vLLM's CPU build (its torch).
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest

from heteroflow.agent.launch import task_env
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.core.gang import Stage, gang_places, stage_ports
from heteroflow.core.ports import PortMapping, host_ports, ports_to_dicts, with_host_ports
from heteroflow.schemas.nodes import TaskAssignment

from .test_vllm_real import vllm_python

pytestmark = pytest.mark.e2e

# A stage's own program: nothing but the platform's variables tells it where its peer is.
ALL_REDUCE = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
t = torch.tensor([float(os.environ["RANK"]) + 1.0])
dist.all_reduce(t)
print("SUM", t.item(), "RANK", dist.get_rank(), "OF", dist.get_world_size(), flush=True)
dist.destroy_process_group()
"""


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def assignment(rank: int, ports: tuple[PortMapping, ...], gang: dict[str, object],
               python: str) -> TaskAssignment:
    return TaskAssignment.model_validate(
        {
            "id": f"task-gang-{rank}", "group_id": "tg-gang", "name": f"gang-{rank}",
            "status": "starting", "task_type": "container", "model_name": "gang",
            "model_path": "", "image": "", "engine": "",
            "command": [python, "-c", ALL_REDUCE], "engine_args": [], "env": ["RANK=9"],
            "ports": ports_to_dicts(ports), "gpu_ids": [], "gpu_required": 0,
            "memory_mb": 0, "parallelism": "pipeline", "health_check": {}, "gang": gang,
        }
    )


@pytest.mark.feature("G1")
@pytest.mark.feature("C1")
@pytest.mark.feature("G3")
def test_two_stages_all_reduce_from_the_platforms_environment(tmp_path: Path) -> None:
    python = vllm_python()
    booked = iter(free_ports(3))  # the pool's choice on this one node
    placed = []
    for rank in range(2):
        ports = stage_ports((PortMapping(8000),), rank)
        placed.append(with_host_ports(ports, [next(booked) for _ in ports]))
    places = gang_places([Stage(r, "127.0.0.1", p) for r, p in enumerate(placed)])
    runtime = ProcessRuntime(tmp_path)
    try:
        for rank, ports in enumerate(placed):
            t = assignment(rank, ports, places[rank].to_dict(), python)
            env = task_env(t)
            assert env["RANK"] == str(rank) and "MASTER_ADDR" in env  # not the user's 9
            runtime.start(
                LaunchSpec(t.id, tuple(t.command), env, host_ports(ports, chosen_only=True))
            )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(
            runtime.exit_code(f"task-gang-{r}") is None for r in range(2)
        ):
            time.sleep(0.2)
        logs = {r: runtime.log_tail(f"task-gang-{r}", 50) for r in range(2)}
        for r in range(2):
            assert runtime.exit_code(f"task-gang-{r}") == 0, logs
            assert f"SUM 3.0 RANK {r} OF 2" in logs[r], logs
    finally:
        for r in range(2):
            runtime.remove(f"task-gang-{r}")
