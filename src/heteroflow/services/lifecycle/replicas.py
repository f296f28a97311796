"""One rule for a new task made from an existing one's intent (E1 rebuilds, I2 scale-out,
and whatever else copies a replica).

``new_replica`` copies every intent field of ``src`` — image, engine, command, engine
arguments, environment, ports, memory figures, kv offload, volumes, priority and whether
it may be preempted, the card share —
and strips what belonged to ``src``'s placement: no node, no cards, pool host ports
given back (a fixed host port stays what was asked), no QoS, no launch argv. The copy
is ``pending`` (the scheduler places it), belongs to ``src``'s tenant and owner (N5: the
group's creator), and takes the group's current health check. ``changes`` replaces named
intent fields (an engine fallback's engine and image, a rolling update's new image).

The caller adds the row and writes whatever marks the old task (``replaced_by``) and
the events.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from heteroflow.core.ids import new_id
from heteroflow.core.ports import ports_from_dicts, ports_to_dicts
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Task

# the intent fields ``changes`` may replace
CHANGEABLE = frozenset(
    {"image", "engine", "engine_reason", "command", "engine_args", "env", "kv_offload_gb"}
)


def new_replica(
    src: Task,
    *,
    rank: int,
    message: str,
    health_check: Mapping[str, Any],
    now: datetime,
    task_id: str | None = None,
    name: str | None = None,
    generation: int | None = None,
    rebuild_count: int = 0,
    replaced_by: str = "",
    changes: Mapping[str, Any] | None = None,
) -> Task:
    """A new pending task of ``rank`` with ``src``'s intent (see the module docstring);
    ``name`` and ``generation`` default to ``src``'s."""
    ch = dict(changes or {})
    unknown = set(ch) - CHANGEABLE
    if unknown:
        raise ValueError(f"not an intent field a copy may change: {sorted(unknown)}")
    return Task(
        id=task_id or new_id("task"),
        group_id=src.group_id,
        tenant_id=src.tenant_id,
        created_by=src.created_by,  # N5: the group's creator, whoever asked for the copy
        name=src.name if name is None else name,
        rank=rank,
        generation=src.generation if generation is None else generation,
        task_type=src.task_type,
        status=TaskStatus.PENDING.value,
        status_message=message,
        gpu_required=src.gpu_required,
        gpu_type=src.gpu_type,
        gpu_ids=[],
        node_id=None,
        model_path=src.model_path,
        model_name=src.model_name,
        image=ch.get("image", src.image),
        engine=ch.get("engine", src.engine),
        engine_reason=ch.get("engine_reason", src.engine_reason),
        command=list(ch.get("command", src.command)),
        engine_args=list(ch.get("engine_args", src.engine_args)),
        env=list(ch.get("env", src.env)),
        ports=ports_to_dicts(p.released() for p in ports_from_dicts(src.ports)),
        estimated_gpu_memory_mb=src.estimated_gpu_memory_mb,
        estimate_detail=src.estimate_detail,
        memory_mb=src.memory_mb,
        kv_offload_gb=ch.get("kv_offload_gb", src.kv_offload_gb),
        volumes=[dict(v) for v in src.volumes],  # A2: a rebuild and an update keep them
        preemptible=src.preemptible,
        max_loras=src.max_loras,  # LoRA slots: a rebuild and an update keep them
        gpu_memory_utilization=src.gpu_memory_utilization,
        priority=src.priority,
        priority_class=src.priority_class,
        health_check=dict(health_check),
        rebuild_count=rebuild_count,
        replaced_by=replaced_by,
        created_at=now,
        updated_at=now,
    )


def rank_name(src: Task, group_name: str, rank: int) -> str:
    """The name a new rank's task gets: create names them ``{group}-{rank}`` unless the
    task spec named them all alike; a copy follows the same rule."""
    return f"{group_name}-{rank}" if src.name == f"{group_name}-{src.rank}" else src.name
