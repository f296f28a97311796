"""Inference dedup at create (L1-L4, issue 16): reuse a service that already serves the
model instead of starting another engine.

**One decision, two callers.** ``decide`` is the whole rule; the create
(``task_groups.create_group``) applies it with ``reuse``, the dry run shows it with
``Decision.preview`` — so a dry run answers what the create does.

**The rule.** With ``inference_dedup_enabled`` on, an inference create with a
``model_path`` (and no ``volumes`` of its own: what it mounts is part of what it serves,
A2) looks for a live service (not deleted, meant to run, status running or
sleeping) whose current tasks run the same ``model_path`` with the same ``image``: the
caller's tenant's first; with ``cross_tenant_dedup_enabled`` also on, those of the
tenants in the caller's sharing group (an operator's configuration, read now). Running
first, then the oldest. A running one is reused; a sleeping one is woken through the
wake path (``sleep.wake_group``: node liveness and borrowed cards are checked there),
or, when it cannot wake now, its wake is recorded (``wake_requested``) and the create
still answers at once with a warning.

**What the caller gets.** No group and no engine: a route of its own tenant to the
reused group (same tenant: only when none of that model name points there yet; another
tenant: its own (tenant, model name) route), added (``added: true``) so every key of the
tenant may call it and the caller may delete it; and, when the create asks for an API
(every create with a model path does), its own endpoint and key on that group — so the
service answers the caller's key at once. The answer is the reused group (for another
tenant's group without its tasks and labels), ``endpoint`` the caller's endpoint,
``api_key`` its key, and ``dedup`` what happened.

**Own-only members (N5).** A member of a tenant whose members see only their own
services reuses only services they created (another member's would answer with a group
they may not see).

**Failing closed.** A sharing-group lookup that fails is no sharing: the create goes on
with its own tenant's services only (a warning says so), never another tenant's.

**Reuse without disclosure (issue 26).** Across tenants each side sees only its own: the
caller's answer (create and dry run) names what it owns — its tenant, the name and model
name it asked for, its endpoint, key and route — and the service's status, never the
owner's group id, name, tenant, tasks, nodes, paths or configuration (``_tenant_view``;
``dedup.group_id`` is empty, a wait is said by its branch, not by the owner's node or
the borrower's task); the owner's events say "another tenant of its sharing group",
never who. Operators see the link: their own creates answer it in full, and
``GET /api/v1/model-routes?group_id=…`` lists every tenant's route to a service.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.events import EventKind
from heteroflow.core.ids import key_display_prefix, new_api_key, new_id
from heteroflow.core.states import GroupStatus, TaskStatus
from heteroflow.db.tables import Event, InferenceEndpoint, ModelRoute, Task, TaskGroup, Tenant
from heteroflow.schemas.capabilities import CapabilitiesRead
from heteroflow.schemas.dedup import DedupAction, DedupLevel, DedupRead
from heteroflow.schemas.routing import DEFAULT_ALGORITHM, hash_key
from heteroflow.schemas.sleep import DEFERRED, WakeResult
from heteroflow.schemas.task_groups import TaskGroupCreated, TaskGroupRead
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle.sleep import wake_blocker, wake_group
from heteroflow.services.placement.planning import GroupPlan
from heteroflow.services.serving.capabilities import of_tasks
from heteroflow.services.serving.endpoints import lock_live_group
from heteroflow.services.tenancy.platform_settings import switches
from heteroflow.services.tenancy.sharing import SharingLookupFailed, sharing_peers
from heteroflow.services.views import group_read

log = logging.getLogger(__name__)

LIVE = (GroupStatus.RUNNING.value, GroupStatus.SLEEPING.value)
LOOKUP_FAILED = (
    "cross-tenant dedup skipped: the sharing group could not be read, so only this "
    "tenant's services were considered (fail-closed)"
)
_ON_ITS_WAY = frozenset({"waking", "already_running", "starting"})
# why another tenant's service cannot wake yet, as its reuser is told: the branch in
# words, without the owner's node, cards or the borrowing task (issue 26)
_HIDDEN_WHY = {
    "node_offline": "its node is offline; it wakes when the node is back",
    "card_borrowed": "its card is lent to other work; it wakes when that work ends",
}
# the owner's events name no other tenant or its users (issue 26)
ANOTHER_TENANT = "another tenant of its sharing group"


def _hidden_why(branch: str) -> str:
    return _HIDDEN_WHY.get(branch, "it cannot be woken now")


@dataclass
class Decision:
    """What a create with this plan does about dedup: ``group`` None = create normally."""

    group: TaskGroup | None = None
    cross_tenant: bool = False
    hide: bool = False  # another tenant's, answered to a member: nothing of the owner shown
    owner: str = ""  # " of tenant <name>" when the group is another tenant's
    subject: str = ""  # "service 'x' (tg-…) of tenant … already serves <model_path>"
    action: DedupAction = "reused"
    level: DedupLevel = "success"
    message: str = ""
    warnings: list[str] = field(default_factory=list)

    def preview(self, model_name: str) -> DedupRead | None:
        """The dry run's answer: what the create would do (nothing written)."""
        if self.group is None:
            return None
        return DedupRead(
            action=self.action, level=self.level, message=self.message,
            group_id="" if self.hide else self.group.id, group_status=self.group.status,
            cross_tenant=self.cross_tenant, model_name=model_name,
        )


def decide(
    s: Session, clock: Clock, who: Principal, plan: GroupPlan, *, offline_after_s: float
) -> Decision:
    """The one dedup decision (L2, L4). Reads only."""
    out = Decision()
    spec = plan.req.task
    if plan.task_type != "inference" or not spec.model_path or spec.volumes:
        return out  # A2: a create's own mounts (adapters, caches) are not another's
    on = switches(s)
    if not on.inference_dedup_enabled:
        return out
    tenants = {who.tenant_id}
    if on.cross_tenant_dedup_enabled:
        try:
            tenants |= sharing_peers(s, who.tenant_id)
        except SharingLookupFailed:
            out.warnings.append(LOOKUP_FAILED)
    found = _candidates(s, tenants, spec.model_path, spec.image)
    if who.own_only:  # N5: a member who sees only their own services reuses only those
        found = [g for g in found if g.created_by == who.user_id]
    if not found:
        return out
    # the caller's own tenant first, then running before sleeping, then the oldest
    found.sort(key=lambda g: (g.tenant_id != who.tenant_id, g.status != "running", g.created_at))
    g = found[0]
    out.group, out.cross_tenant = g, g.tenant_id != who.tenant_id
    out.hide = out.cross_tenant and not who.is_operator
    if out.hide:
        out.subject = "a service of another tenant in your sharing group already serves this model"
    else:
        if out.cross_tenant:
            owner = s.get(Tenant, g.tenant_id)
            out.owner = f" of tenant {owner.name if owner is not None else g.tenant_id}"
        out.subject = f"service {g.name!r} ({g.id}){out.owner} already serves {spec.model_path}"
    asleep = [t for t in _current(s, g.id) if t.status == TaskStatus.SLEEPING.value]
    if g.status == GroupStatus.RUNNING.value or not asleep:
        out.message = (
            f"{out.subject} with the same image: it is reused, no new engine starts; call "
            f"it as model {plan.model_name!r}"
        )
        return out
    blocked = [
        b for t in asleep
        if (b := wake_blocker(s, clock, t, offline_after_s=offline_after_s)) is not None
    ]
    if len(blocked) == len(asleep):
        why = _hidden_why(blocked[0][0]) if out.hide else blocked[0][1]
        out.action, out.level, out.message = _deferred(out.subject, why)
    else:
        out.action, out.level, out.message = _waking(out.subject, plan.model_name)
    return out


def _waking(subject: str, model_name: str) -> tuple[DedupAction, DedupLevel, str]:
    return "woken", "info", (
        f"{subject} and was asleep: it is woken and answers model {model_name!r} once its "
        "health check passes"
    )


def _deferred(subject: str, why: str) -> tuple[DedupAction, DedupLevel, str]:
    return "wake_requested", "warning", f"{subject} but sleeps and cannot wake yet: {why}"


def _candidates(
    s: Session, tenants: set[str], model_path: str, image: str
) -> list[TaskGroup]:
    same = select(Task.group_id).where(
        Task.replaced_by == "", Task.model_path == model_path, Task.image == image
    )
    q = select(TaskGroup).where(
        TaskGroup.tenant_id.in_(sorted(tenants)),
        TaskGroup.deleted_at.is_(None),
        TaskGroup.task_type == "inference",
        TaskGroup.desired == "running",
        TaskGroup.status.in_(LIVE),
        TaskGroup.id.in_(same),
    )
    return list(s.scalars(q))


def _current(s: Session, group_id: str) -> list[Task]:
    q = select(Task).where(Task.group_id == group_id, Task.replaced_by == "").order_by(Task.rank)
    return list(s.scalars(q.execution_options(populate_existing=True)))


def reuse(
    s: Session,
    clock: Clock,
    who: Principal,
    plan: GroupPlan,
    decision: Decision,
    *,
    offline_after_s: float,
) -> TaskGroupCreated | None:
    """Apply a decision that found a group (L2, L3). None: it was deleted meanwhile, so
    the caller creates normally."""
    g = decision.group
    assert g is not None
    now = clock.now()
    if not lock_live_group(s, g.id, now):  # serialises with its delete (as route creation)
        return None
    model_name = plan.model_name
    action, level, message = decision.action, decision.level, decision.message
    wake: list[WakeResult] = []
    if decision.action != "reused":  # it slept: woken through the wake path (F2, F3)
        by = ANOTHER_TENANT if decision.cross_tenant else who.username
        reason = f"a create by {by} reuses it (dedup)"
        wake = wake_group(s, clock, g.id, reason, who=None, offline_after_s=offline_after_s)
        action, level, message = _woken(decision, wake, model_name)
    route = s.scalar(
        select(ModelRoute).where(
            ModelRoute.tenant_id == who.tenant_id,
            ModelRoute.model_name == model_name,
            ModelRoute.group_id == g.id,
        )
    )
    added = route is None
    if route is None:  # same tenant: dedup by model name; another: its own route (L3)
        route = ModelRoute(
            id=new_id("mr"), tenant_id=who.tenant_id, group_id=g.id, model_name=model_name,
            priority=0, weight=100, version="v1", active=True, algorithm=DEFAULT_ALGORITHM,
            tags=[], added=True, created_at=now, updated_at=now,
        )
        s.add(route)
    api_key: str | None = None
    endpoint_id: str | None = None
    if plan.enable_api:
        api_key = new_api_key()
        own = s.get(InferenceEndpoint, g.endpoint_id) if g.endpoint_id else None
        endpoint = InferenceEndpoint(
            id=new_id("ep"), tenant_id=who.tenant_id, group_id=g.id,
            name=plan.endpoint_name, port=own.port if own is not None else plan.endpoint_port,
            external_port=plan.req.external_port, key_hash=hash_key(api_key),
            key_prefix=key_display_prefix(api_key), created_by=who.user_id,
            created_at=now, updated_at=now,
        )
        s.add(endpoint)
        endpoint_id = endpoint.id
    # the owner reads its group's events: another tenant is not named (issue 26)
    by = ANOTHER_TENANT if decision.cross_tenant else (
        f"{who.username} of tenant {who.tenant_id} as model {model_name!r}")
    s.add(
        Event(
            group_id=g.id, kind=EventKind.DEDUP_REUSED.value, to_status=action,
            message=f"reused (dedup) by {by}: {action}", created_at=now,
        )
    )
    s.flush()
    s.refresh(g)
    tasks = list(s.scalars(
        select(Task).where(Task.group_id == g.id).execution_options(populate_existing=True)
    ))
    if decision.hide:
        read = _tenant_view(g, tasks, who, plan, endpoint_id, now)
        wake = []  # the owner's task ids, nodes and borrowers: the message says enough
    else:
        # the caller's endpoint is the one its key opens; another tenant's tasks unseen
        update: dict[str, object] = {"endpoint": endpoint_id}
        if decision.cross_tenant:
            update |= {"tasks": [], "labels": {}}
        read = group_read(g, tasks).model_copy(update=update)
    # the link, for the operator's log only
    log.info("create by %s (tenant %s) reused group %s (%s)", who.username, who.tenant_id,
             g.id, action)
    return TaskGroupCreated(
        **read.model_dump(),
        api_key=api_key,
        warnings=[*plan.warnings, *decision.warnings],
        dedup=DedupRead(
            action=action, level=level, message=message,
            group_id="" if decision.hide else g.id, group_status=g.status,
            cross_tenant=decision.cross_tenant, model_name=model_name, route_id=route.id,
            route_added=added, endpoint_id=endpoint_id, wake=wake,
        ),
    )


def _tenant_view(
    g: TaskGroup,
    tasks: list[Task],
    who: Principal,
    plan: GroupPlan,
    endpoint_id: str | None,
    now: datetime,
) -> TaskGroupRead:
    """Another tenant's service as its reuser is answered (issue 26): what the caller owns
    (its tenant, the name and model name it asked for, its endpoint) and what it needs
    to call it (status, capabilities); no group id (it owns none), and nothing of the
    owner's — name, tasks, nodes, paths, labels, configuration, its own timestamps.
    Listed field by field, so a field added to the group later stays unshown here."""
    return TaskGroupRead(
        id="", tenant_id=who.tenant_id, name=plan.req.name, model_name=plan.model_name,
        task_type="inference", parallelism=plan.req.parallelism, world_size=0,
        current_replicas=0, min_replicas=0, max_replicas=0, enable_api=plan.enable_api,
        endpoint=endpoint_id, inference_templates=[], current_generation=0,
        rolling_update_state=None, rolling_update_message=None, idle_timeout_minutes=0,
        gpu_memory_utilization=0, priority=0, desired=g.desired, health_check={},
        labels={}, status=g.status, status_message="", created_at=now, updated_at=now,
        capabilities=CapabilitiesRead.of(of_tasks(tasks)),
    )


def _woken(
    decision: Decision, wake: list[WakeResult], model_name: str
) -> tuple[DedupAction, DedupLevel, str]:
    """What the wake really did (the decision predicted it; a race may differ)."""
    if any(w.branch in _ON_ITS_WAY for w in wake):
        return _waking(decision.subject, model_name)
    deferred = [w for w in wake if w.branch in DEFERRED]
    why = (deferred or wake)[0].message if wake else "no task could be woken"
    if decision.hide:
        why = _hidden_why(deferred[0].branch if deferred else "")
    if deferred:
        return _deferred(decision.subject, why)
    return "woken", "warning", f"{decision.subject} but its wake failed: {why}"
