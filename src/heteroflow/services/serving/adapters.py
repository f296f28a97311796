"""A service's LoRA adapters (core.lora): list, add, remove; each served under its own name.

An adapter is an entry of ``task_groups.lora_adapters`` and a model route of its name to
the group (made with the group, not ``added``: the group's keys may call it, as they call
its model; ``services.serving.routing`` marks it ``adapter`` for the gateway). The agent
of each replica's node loads the list into the running engine at runtime (the heartbeat
carries it, ``TaskAssignment.lora_adapters``), so adding one serves it without a restart
and removing one takes its name away at once (the route goes in the same unit of work)
and out of the engines at the next heartbeat.

Rules, each a clear answer naming the field:

* the group must exist and be the caller's (404), be an inference service whose tasks
  were created with ``max_loras`` > 0 (409: it is fixed at create, since the engine's
  flags are), and hold fewer adapters than that (409);
* ``name``: a model name (the schema's pattern), not the group's own model and no model
  name of the tenant already (409, ``name``); two adds of one name at once: the tenant's
  row is held while the name is checked and written, and the route's unique index
  refuses a second one to the same group (``services.unique``);
* ``path``: the model path's rule (``core.lora.adapter_path_refusal`` over
  ``core.paths``) against the volume rules of the nodes the caller may use (400, ``path``).
"""

from __future__ import annotations

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Conflict, NotFound, ValidationFailed
from heteroflow.core.ids import new_id
from heteroflow.core.lora import Adapter, adapter_path_refusal, adapters_of
from heteroflow.core.paths import VolumeRule
from heteroflow.db.tables import ModelRoute, Task, TaskGroup
from heteroflow.schemas.adapters import AdapterCreate, AdapterRead, AdaptersRead
from heteroflow.schemas.routing import DEFAULT_ALGORITHM
from heteroflow.services.identity.access import visible_group
from heteroflow.services.identity.auth import Principal
from heteroflow.services.placement.fleet import read_fleet
from heteroflow.services.serving.endpoints import lock_live_group
from heteroflow.services.tenancy.quotas import lock_tenant
from heteroflow.services.unique import taken_as


def _max_loras(s: Session, g: TaskGroup) -> int:
    """How many adapters the group's engines hold at once: its current tasks' setting."""
    q = select(func.max(Task.max_loras)).where(Task.group_id == g.id, Task.replaced_by == "")
    return int(s.scalar(q) or 0)


def _read(s: Session, g: TaskGroup) -> AdaptersRead:
    return AdaptersRead(
        group_id=g.id,
        max_loras=_max_loras(s, g),
        adapters=[AdapterRead(name=a.name, path=a.path) for a in adapters_of(g.lora_adapters)],
    )


def list_adapters(s: Session, who: Principal, group_id: str) -> AdaptersRead:
    return _read(s, visible_group(s, who, group_id))


def _name_taken(name: str, where: str) -> Conflict:
    return Conflict(
        f"model name {name!r} is already {where} in this tenant: an adapter's name is a "
        "model name of its own; choose another",
        field="name",
    )


def _check_name(s: Session, g: TaskGroup, name: str) -> None:
    if name == g.model_name:
        raise _name_taken(name, "this service's own model")
    clash = s.scalar(
        select(ModelRoute.group_id).where(
            ModelRoute.tenant_id == g.tenant_id, ModelRoute.model_name == name
        ).limit(1)
    )
    if clash is not None:
        raise _name_taken(name, "a model name (a route)")


def check_not_an_adapter(s: Session, tenant_id: str, model_name: str) -> None:
    """A new service's model name may not be one of the tenant's adapters (409 naming
    ``model_name``): the name would route to the adapter and to the new model at once."""
    q = (
        select(ModelRoute.group_id)
        .join(TaskGroup, TaskGroup.id == ModelRoute.group_id)
        .where(
            ModelRoute.tenant_id == tenant_id,
            ModelRoute.model_name == model_name,
            ModelRoute.added.is_(False),
            TaskGroup.model_name != model_name,
        )
        .limit(1)
    )
    holder = s.scalar(q)
    if holder is not None:
        raise Conflict(
            f"model name {model_name!r} is a LoRA adapter of service {holder} in this tenant; "
            "choose another model_name (or remove the adapter first)",
            field="model_name",
        )


def _check_path(
    s: Session, clock: Clock, g: TaskGroup, path: str, offline_after_s: float
) -> None:
    nodes = [n for n in read_fleet(s, clock, offline_after_s).nodes if n.visible_to(g.tenant_id)]
    rules = [VolumeRule(n.allowed_volume_prefixes, n.denied_volume_prefixes) for n in nodes]
    problem = adapter_path_refusal(path, rules, "of every node you may use")
    if problem:
        raise ValidationFailed(problem, field="path")


def add_adapter(
    s: Session,
    who: Principal,
    clock: Clock,
    group_id: str,
    req: AdapterCreate,
    *,
    offline_after_s: float,
) -> AdaptersRead:
    """Serve the adapter at ``req.path`` under ``req.name`` beside the service's model."""
    g = visible_group(s, who, group_id)
    if g.task_type != "inference":
        raise Conflict(f"task group {g.id} is a {g.task_type} group, not a service", field="name")
    limit = _max_loras(s, g)
    if limit <= 0:
        raise Conflict(
            f"service {g.id} was created without LoRA (task.max_loras 0): its engines were "
            "started without adapter slots; create it with task.max_loras > 0",
            field="max_loras",
        )
    _check_path(s, clock, g, req.path, offline_after_s)
    now = clock.now()
    lock_tenant(s, g.tenant_id)  # two adds of one name in the tenant: one at a time
    if not lock_live_group(s, g.id, now):
        raise NotFound(f"task group {group_id!r} not found")
    s.refresh(g)  # the list as the lock holder left it
    current = adapters_of(g.lora_adapters)
    if any(a.name == req.name for a in current):
        raise _name_taken(req.name, "an adapter of this service")
    if len(current) >= limit:
        raise Conflict(
            f"service {g.id} holds {len(current)} adapter(s), its max_loras: remove one "
            "first (DELETE .../adapters/{name})",
            field="max_loras",
        )
    _check_name(s, g, req.name)
    g.lora_adapters = [a.as_dict() for a in (*current, Adapter(req.name, req.path))]
    g.updated_at = now
    base = s.scalar(
        select(ModelRoute).where(
            ModelRoute.group_id == g.id,
            ModelRoute.model_name == g.model_name,
            ModelRoute.tenant_id == g.tenant_id,
        )
    )
    route = ModelRoute(
        id=new_id("mr"), tenant_id=g.tenant_id, group_id=g.id, model_name=req.name,
        priority=0, weight=100, version="v1", active=True,
        algorithm=base.algorithm if base is not None else DEFAULT_ALGORITHM,
        tags=list(base.tags) if base is not None else [], added=False,
        created_at=now, updated_at=now,
    )
    with taken_as(s, _name_taken(req.name, "an adapter of this service")):
        s.add(route)
    return _read(s, g)


def remove_adapter(
    s: Session, who: Principal, clock: Clock, group_id: str, name: str
) -> AdaptersRead:
    """Stop serving adapter ``name``: its route goes now, the engines unload it next."""
    g = visible_group(s, who, group_id)
    now = clock.now()
    if not lock_live_group(s, g.id, now):
        raise NotFound(f"task group {group_id!r} not found")
    s.refresh(g)
    current = adapters_of(g.lora_adapters)
    if not any(a.name == name for a in current):
        raise NotFound(f"adapter {name!r} not found on task group {g.id}")
    g.lora_adapters = [a.as_dict() for a in current if a.name != name]
    g.updated_at = now
    s.execute(
        delete(ModelRoute).where(
            ModelRoute.group_id == g.id,
            ModelRoute.tenant_id == g.tenant_id,
            ModelRoute.model_name == name,
            ModelRoute.added.is_(False),
        )
    )
    s.flush()
    return _read(s, g)
