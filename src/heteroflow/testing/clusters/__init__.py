"""Simulated clusters: one JSON file per node kind, for tests and ``bench/scheduler.py``.

SIMULATED. None of these nodes exists: each file describes what an agent on such a
machine would report (card model strings, memory in MiB, compute capability, MIG/MPS,
NVLink peers) from vendor data sheets, and says ``"simulated": true`` in a field the
loader insists on. Kinds: 8xH100 SXM with NVLink and RDMA, 2xA10, 4xP100 (cc 6.0),
4xT4 (cc 7.5), 8xA100 with MIG and NVLink, 8xAscend 910B, 8xMI300X with RDMA,
8xMoore Threads MTT S4000.

Two ways in: ``heartbeat_body`` gives the agent's heartbeat JSON, so a test registers a
node through the real agent protocol; ``insert_nodes`` writes ``nodes`` rows in bulk
(one multi-row INSERT) for the benchmark, with the same fields a heartbeat would set.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from importlib import resources
from importlib.resources.abc import Traversable
from types import MappingProxyType
from typing import Any

from sqlalchemy import insert
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.ids import new_id
from heteroflow.db.tables import Node
from heteroflow.schemas.nodes import GpuCardWire, Heartbeat, InventoryWire


@dataclass(frozen=True)
class ClusterKind:
    """One simulated node kind as its data file describes it."""

    kind: str
    description: str
    runtime: str
    cpu_count: int
    memory_total_mb: int
    memory_available_mb: int
    cpu_percent: float
    memory_percent: float
    labels: Mapping[str, str]
    engines: Mapping[str, str]
    cards: tuple[GpuCardWire, ...]

    def cards_of(self, node_name: str) -> list[GpuCardWire]:
        """The cards of one node of this kind; UUIDs name the node (``sim-<name>-gpu<i>``)."""
        return [c.model_copy(update={"uuid": f"sim-{node_name}-gpu{c.index}"}) for c in self.cards]


def _files() -> dict[str, Traversable]:
    return {
        f.name.removesuffix(".json").replace("_", "-"): f
        for f in resources.files(__name__).iterdir()
        if f.name.endswith(".json")
    }


def kinds() -> tuple[str, ...]:
    """The names of every simulated node kind, sorted."""
    return tuple(sorted(_files()))


def load(kind: str) -> ClusterKind:
    """Read and check one kind's file; ValueError names the kind and what is wrong."""
    files = _files()
    if kind not in files:
        raise ValueError(f"unknown cluster kind {kind!r}; one of {', '.join(sorted(files))}")
    doc = json.loads(files[kind].read_text(encoding="utf-8"))
    if doc.get("simulated") is not True:
        raise ValueError(f"cluster kind {kind!r}: the file must say \"simulated\": true")
    if doc.get("kind") != kind:
        raise ValueError(f"cluster kind {kind!r}: the file names kind {doc.get('kind')!r}")
    node = doc["node"]
    cards = tuple(GpuCardWire.model_validate(c) for c in doc["cards"])
    if [c.index for c in cards] != list(range(len(cards))):
        raise ValueError(f"cluster kind {kind!r}: card indices must be 0..{len(cards) - 1}")
    return ClusterKind(
        kind=kind,
        description=str(doc["description"]),
        runtime=str(node["runtime"]),
        cpu_count=int(node["cpu_count"]),
        memory_total_mb=int(node["memory_total_mb"]),
        memory_available_mb=int(node["memory_available_mb"]),
        cpu_percent=float(node["cpu_percent"]),
        memory_percent=float(node["memory_percent"]),
        labels=MappingProxyType(dict(node["labels"])),
        engines=MappingProxyType(dict(node["engines"])),
        cards=cards,
    )


def heartbeat(kind: str, name: str, *, address: str = "127.0.0.1") -> Heartbeat:
    """The heartbeat an agent on a node of ``kind`` called ``name`` would send."""
    k = load(kind)
    return Heartbeat.model_validate(
        {
            "name": name,
            "address": address,
            "runtime": k.runtime,
            "inventory": InventoryWire(
                gpus=k.cards_of(name),
                cpu_count=k.cpu_count,
                memory_total_mb=k.memory_total_mb,
                memory_available_mb=k.memory_available_mb,
                cpu_percent=k.cpu_percent,
                memory_percent=k.memory_percent,
            ),
            "labels": dict(k.labels),
            "engines": dict(k.engines),
        }
    )


def heartbeat_body(kind: str, name: str, *, address: str = "127.0.0.1") -> dict[str, Any]:
    """The JSON body of ``POST /api/v1/agent/heartbeat`` for that node."""
    return heartbeat(kind, name, address=address).model_dump(mode="json")


def node_row(kind: ClusterKind, name: str, now: datetime, node_id: str) -> dict[str, Any]:
    """The ``nodes`` row the heartbeat service would write for a fresh node of ``kind``."""
    return {
        "id": node_id,
        "name": name,
        "address": "127.0.0.1",
        "runtime": kind.runtime,
        "gpus": [c.model_dump() for c in kind.cards_of(name)],
        "cpu_count": kind.cpu_count,
        "memory_total_mb": kind.memory_total_mb,
        "memory_available_mb": kind.memory_available_mb,
        "cpu_percent": kind.cpu_percent,
        "memory_percent": kind.memory_percent,
        "models": [],
        "engines": dict(kind.engines),
        "labels": dict(kind.labels),
        "booking_version": 0,
        "registered_at": now,
        "last_heartbeat_at": now,
    }


def insert_nodes(
    s: Session, kind: str, count: int, clock: Clock, *, prefix: str = ""
) -> list[str]:
    """Write ``count`` online nodes of ``kind`` (named ``<prefix or kind>-00000``...) in one
    executemany INSERT; returns their ids in name order."""
    k = load(kind)
    now = clock.now()
    stem = prefix or kind
    rows = [node_row(k, f"{stem}-{i:05d}", now, new_id("node")) for i in range(count)]
    if rows:
        s.execute(insert(Node), rows)
    return [str(r["id"]) for r in rows]
