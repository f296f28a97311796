"""The distributed environment of a gang (G1, C1): what each stage of a ``pipeline``
group is told so that it finds its peers.

A gang is ``world_size`` stages placed all-or-nothing across nodes (core.placement's
``place_gang``). Each stage runs one process (one engine, one ``torchrun`` worker group,
one container), so its rank is its stage's rank and its local rank 0. Rank 0's node hosts
the rendezvous: one more host port is booked there from the node's port pool, as every
task's ports are (P2) — rank 0's ports list carries it as an extra mapping with no
container port (``RENDEZVOUS``, container port 0: nothing is published for it; the
stages run on the host network, C5), so it is booked, released and re-booked with the
task's other ports and needs no column of its own.

``gang_places`` turns the placement (each stage's rank, node address and booked ports)
into one ``GangPlace`` per stage: the scheduler's decision as the dry run shows it and as
the server hands it to each stage's agent at its claim. ``gang_env`` is the environment
those give a stage, in the names the common launchers read (torchrun and
``torch.distributed``'s ``env://`` init, Lightning, DeepSpeed): the recipe
(``core.recipe`` for containers, ``core.process_recipe`` for processes) sets it through
``core.containers.container_env``, so the dry run and the agent cannot disagree. The
names are the agent's (``GANG_ENV``): a task's own values of them are dropped (C3).

The stage's engine listens on its booked host port (``HETEROFLOW_STAGE_PORT``, the first
mapping's host port): on the host network nothing translates the container port, and the
agent's health check probes the booked port.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from heteroflow.core.ports import PortMapping

__all__ = [
    "GANG_ENV",
    "RENDEZVOUS",
    "GangPlace",
    "Stage",
    "gang_env",
    "gang_places",
    "rendezvous_port",
    "serves_api",
    "stage_ports",
    "stage_shape",
]

#: The extra mapping rank 0 books for the gang's rendezvous: a host port from the pool,
#: no container port (the stage is on the host network and binds the host port itself).
RENDEZVOUS = PortMapping(0)

#: Every name ``gang_env`` may set: the agent's own (core.containers.AGENT_OWNED_ENV).
GANG_ENV = frozenset(
    {
        "MASTER_ADDR",
        "MASTER_PORT",
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "HETEROFLOW_STAGE_GPU_IDS",
        "HETEROFLOW_STAGE_PORT",
    }
)


@dataclass(frozen=True, slots=True)
class GangPlace:
    """Where one stage stands in its gang: its rank, the gang's size and its rendezvous."""

    rank: int
    world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def of(cls, value: GangPlace | Mapping[str, Any] | None) -> GangPlace | None:
        """From the wire's dict (``TaskAssignment.gang``) or as it is."""
        if value is None or isinstance(value, GangPlace):
            return value
        return cls(
            int(value["rank"]), int(value["world_size"]), str(value["master_addr"]),
            int(value["master_port"]),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "master_addr": self.master_addr,
            "master_port": self.master_port,
        }


@dataclass(frozen=True, slots=True)
class Stage:
    """One placed stage: its rank, its node's address and its booked ports."""

    rank: int
    address: str
    ports: tuple[PortMapping, ...]


def stage_ports(ports: Sequence[PortMapping], rank: int) -> tuple[PortMapping, ...]:
    """A stage's ports as the create writes them: rank 0 books the rendezvous too."""
    return (*ports, RENDEZVOUS) if rank == 0 else tuple(ports)


def rendezvous_port(ports: Sequence[PortMapping]) -> int:
    """The host port booked for the rendezvous (0: none, or not chosen yet)."""
    return next((p.host_port for p in ports if p.container_port == 0), 0)


def gang_places(stages: Sequence[Stage]) -> list[GangPlace]:
    """One place per stage, in the order given: ``MASTER_ADDR`` and ``MASTER_PORT`` are
    rank 0's node address and booked rendezvous port. ValueError when the gang is not
    whole (no rank 0, a rank twice or out of range): the gang is placed whole or not at
    all, so that is a broken invariant, never a waiting state."""
    ranks = sorted(s.rank for s in stages)
    if ranks != list(range(len(stages))):
        raise ValueError(f"a gang's stages must be ranks 0-{len(stages) - 1}, got {ranks}")
    master = next(s for s in stages if s.rank == 0)
    port = rendezvous_port(master.ports)
    return [GangPlace(s.rank, len(stages), master.address, port) for s in stages]


def gang_env(
    place: GangPlace | None, gpu_ids: Sequence[int], ports: Sequence[PortMapping] = ()
) -> dict[str, str]:
    """The variables a stage at ``place`` starts with ({} outside a gang). One process per
    stage: ``LOCAL_RANK`` 0 and ``NODE_RANK`` its rank; ``HETEROFLOW_STAGE_GPU_IDS`` the
    node's card ids it holds (the vendor's visibility variable is set apart, by the
    GPU request); ``HETEROFLOW_STAGE_PORT`` the booked host port it serves on. A port not
    chosen yet (a plan with no placement) reads 0."""
    if place is None:
        return {}
    served = next((p.host_port or p.container_port for p in ports if p.container_port), 0)
    return {
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": str(place.master_port),
        "RANK": str(place.rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "NODE_RANK": str(place.rank),
        "GROUP_RANK": str(place.rank),
        "HETEROFLOW_STAGE_GPU_IDS": ",".join(str(i) for i in gpu_ids),
        "HETEROFLOW_STAGE_PORT": str(served),
    }


def serves_api(parallelism: str, rank: int) -> bool:
    """Whether a task serves the model's API: every task but an inference gang's stages
    past rank 0, which run their share of the layers headless (vLLM's ``--headless``)
    while rank 0 takes the requests. The gateway routes to rank 0 only; the agent judges
    a headless stage by its process, having no port to probe (issue 32 item 3)."""
    return parallelism != "pipeline" or rank == 0


def stage_shape(place: GangPlace | None, node_address: str) -> dict[str, Any]:
    """An engine stage's part of its ``LaunchShape`` ({} outside a gang): its rank among
    ``world_size`` stages, the rendezvous (rank 0's node address and booked port) and the
    node's own address, where the other stages reach this one. A node address not known
    (a plan with no placement) falls back to the master's for rank 0, which is its own."""
    if place is None:
        return {}
    own = node_address or (place.master_addr if place.rank == 0 else "")
    return {
        "pipeline_parallel_size": place.world_size,
        "pipeline_rank": place.rank,
        "master_addr": place.master_addr,
        "master_port": place.master_port,
        "node_address": own,
    }
