"""Tenant quotas (N2): the reads ``core.quotas`` decides on, the check every door calls,
and the members' view of their usage against their limits.

**One check, serialised per tenant.** A door first takes the tenant's row
(``lock_tenant``: a no-op UPDATE — the row lock on PostgreSQL, the database's write lock
on SQLite, held until commit), then reads the usage and asks ``core.quotas``; so two
creates (or a create and a scale) of one tenant at once cannot both take the last card.
A create takes it before planning (``plan_group`` checks, and its dry run asks the same
question without the lock and without writing).
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from heteroflow.core.errors import NotFound, QuotaExceeded
from heteroflow.core.quotas import Quota, Usage, check, headroom, task_usage
from heteroflow.core.rollout import CANDIDATE
from heteroflow.db.tables import Task, TaskGroup, Tenant
from heteroflow.schemas.auth import QuotaAmounts, TenantQuotaRead
from heteroflow.services.identity.auth import Principal


def lock_tenant(s: Session, tenant_id: str) -> None:
    """Hold the tenant's row until commit (see the module docstring)."""
    s.execute(
        update(Tenant)
        .where(Tenant.id == tenant_id)
        .values(quota_cards=Tenant.quota_cards)
        .execution_options(synchronize_session=False)
    )


def quota_of(t: Tenant) -> Quota:
    return Quota(t.quota_cards, t.quota_services, t.quota_replicas, t.quota_cpu_memory_mb)


def tenant_quota(s: Session, tenant_id: str) -> tuple[str, Quota]:
    """The tenant's name and limits (no limits for a tenant that does not exist)."""
    row = s.execute(
        select(
            Tenant.name, Tenant.quota_cards, Tenant.quota_services, Tenant.quota_replicas,
            Tenant.quota_cpu_memory_mb,
        ).where(Tenant.id == tenant_id)
    ).first()
    if row is None:
        return tenant_id, Quota()
    return str(row[0]), Quota(int(row[1]), int(row[2]), int(row[3]), int(row[4]))


def read_usage(s: Session, tenant_id: str) -> Usage:
    """What the tenant holds (``core.quotas``): its live groups, their current tasks and
    the candidates of rolling updates, whatever their state."""
    services = s.scalar(
        select(func.count())
        .select_from(TaskGroup)
        .where(TaskGroup.tenant_id == tenant_id, TaskGroup.deleted_at.is_(None))
    )
    total = Usage(services=int(services or 0))
    rows = s.execute(
        select(Task.gpu_required, Task.task_type, Task.gpu_memory_utilization, Task.memory_mb)
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(
            TaskGroup.tenant_id == tenant_id,
            TaskGroup.deleted_at.is_(None),
            Task.replaced_by.in_(["", CANDIDATE]),
        )
    )
    for gpus, task_type, util, memory in rows:
        total = total + task_usage(
            gpu_required=gpus, task_type=task_type, gpu_memory_utilization=util,
            memory_mb=memory,
        )
    return total


def require(s: Session, tenant_id: str, need: Usage, doing: str = "this") -> None:
    """``QuotaExceeded`` (409 naming the quota) when ``need`` does not fit."""
    name, quota = tenant_quota(s, tenant_id)
    if not quota.limited:
        return
    refusal = check(name, quota, read_usage(s, tenant_id), need, doing)
    if refusal is not None:
        raise QuotaExceeded(refusal.message, field=refusal.field)


def replica_headroom(s: Session, tenant_id: str, per_replica: Usage) -> tuple[int, str] | None:
    """How many more replicas of ``per_replica`` the tenant's quotas allow and why
    (None: unlimited) — what the autoscaler clamps to."""
    name, quota = tenant_quota(s, tenant_id)
    if not quota.limited:
        return None
    room = headroom(name, quota, read_usage(s, tenant_id), per_replica)
    if room is None:
        return None
    return room[0], room[1].message


def per_replica(t: Task) -> Usage:
    """What one more replica like ``t`` books."""
    return task_usage(
        gpu_required=t.gpu_required, task_type=t.task_type,
        gpu_memory_utilization=t.gpu_memory_utilization, memory_mb=t.memory_mb,
    )


def _amounts(u: Usage | Quota) -> QuotaAmounts:
    return QuotaAmounts(
        cards=u.cards, services=u.services, replicas=u.replicas, cpu_memory_mb=u.cpu_memory_mb
    )


def read_quota(s: Session, who: Principal, tenant_id: str) -> TenantQuotaRead:
    """``GET /api/v1/tenants/{id}/quota``: limits and usage. Members read their own
    tenant's (another tenant's is 404); operators any."""
    if not who.is_operator and tenant_id != who.tenant_id:
        raise NotFound(f"tenant {tenant_id!r} not found")
    t = s.get(Tenant, tenant_id)
    if t is None:
        raise NotFound(f"tenant {tenant_id!r} not found")
    return TenantQuotaRead(
        tenant_id=t.id,
        tenant_name=t.name,
        limits=_amounts(quota_of(t)),
        usage=_amounts(read_usage(s, t.id)),
    )
