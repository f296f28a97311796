"""The update request's check: what an update may change, and whether its new generation
can run — checked as a create checks its task (400 naming the field)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.engines import resolve_engine
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.ports import ports_from_dicts
from heteroflow.db.tables import Task, TaskGroup
from heteroflow.schemas.task_groups import TaskGroupUpdate, TaskSpec, VolumeIn
from heteroflow.services.placement.fleet import read_fleet
from heteroflow.services.placement.planning import check_task

# the task intent an update may change (everything else is inherited)
CHANGEABLE = ("image", "engine_args", "env", "command", "kv_offload_gb")


def _changes(req: TaskGroupUpdate) -> dict[str, Any]:
    return {k: getattr(req, k) for k in CHANGEABLE if getattr(req, k) is not None}


def check_update(
    s: Session,
    clock: Clock,
    g: TaskGroup,
    current: list[Task],
    req: TaskGroupUpdate,
    env_allow: Sequence[str],
    offline_after_s: float,
) -> dict[str, Any]:
    """The update's changes, its new generation checked as a create checks its task (400
    naming the field): what only an update can get wrong here, then ``check_task``."""
    changes = _changes(req)
    if not changes:
        raise ValidationFailed(
            "nothing to update: give image (and / or engine_args, env, command, "
            "kv_offload_gb)",
            field="image",
        )
    head = max(current, key=lambda t: (t.generation, t.created_at))
    engine = head.engine
    if req.strategy == "rolling":
        if g.task_type != "inference":
            raise ValidationFailed(
                f"a rolling update is for inference services (this is {g.task_type}); use "
                "strategy recreate",
                field="strategy",
            )
        fixed = [p.host_port for p in ports_from_dicts(head.ports) if not p.from_pool]
        fixed = [p for p in fixed if p]
        if fixed:
            raise ValidationFailed(
                f"fixed host port(s) {fixed}: the new replica cannot run beside the old one "
                "on the same port; use strategy recreate",
                field="strategy",
            )
    image = changes.get("image")
    if image is not None:
        guessed, _ = resolve_engine("", "", image)
        if engine and guessed and guessed != engine:
            raise ValidationFailed(
                f"image {image!r} looks like a {guessed} image, but this service runs "
                f"{engine}; the engine cannot change in an update (create a new service)",
                field="image",
            )
    kv = changes.get("kv_offload_gb")
    if kv is not None and kv != head.kv_offload_gb and (image is None or image == head.image):
        raise ValidationFailed(
            "kv_offload_gb changes only together with a new image (C12): the offload "
            "flag's form depends on the engine's version",
            field="kv_offload_gb",
        )
    spec = TaskSpec.model_construct(
        image=changes.get("image", head.image),
        gpu_required=head.gpu_required,
        gpu_type=head.gpu_type,
        model_path=head.model_path,
        command=list(changes.get("command", head.command)),
        engine_args=list(changes.get("engine_args", head.engine_args)),
        env=list(changes.get("env", head.env)),
        kv_offload_gb=changes.get("kv_offload_gb", head.kv_offload_gb),
        volumes=[VolumeIn.model_validate(v) for v in head.volumes],  # A2: inherited
    )
    nodes = [
        n for n in read_fleet(s, clock, offline_after_s).nodes if n.visible_to(g.tenant_id)
    ]
    try:
        check_task(
            spec, engine=engine, task_type=g.task_type, parallelism=g.parallelism,
            gpus=head.gpu_required, nodes=nodes, env_allow=env_allow,
        )
    except ValidationFailed as exc:  # the update's body holds the task's fields at its top
        field_ = (exc.field or "").removeprefix("task.") or None
        raise ValidationFailed(exc.message, field=field_) from exc
    return changes


def describe(head: Task, changes: Mapping[str, Any]) -> str:
    parts = []
    for k, v in changes.items():
        old = getattr(head, k)
        parts.append(f"{k} {old!r} -> {v!r}" if k == "image" else f"{k} {v!r}")
    return "; ".join(parts)
