"""Per-tenant quotas (N2), pure: a tenant's limits, its usage and a change in, allowed
or refused out, with a reason naming the quota.

``services/tenancy/quotas.py`` reads the facts and calls this at every door that adds to what
a tenant holds: a create and its dry run (one check in ``plan_group``), a scale-out by
hand or by a new lower bound, the start of a rolling update (its surge), and the
autoscaler, which clamps to ``headroom`` instead of being refused.

**Limits.** ``cards`` (whole cards, by commitment), ``services`` (live task groups),
``replicas`` (their tasks) and ``cpu_memory_mb`` (what CPU work books on its node);
0 means no limit.

**What a task counts** is what the scheduler books for it (``core.placement``): a CPU
task (``gpu_required`` 0) books its ``memory_mb`` (1024 MB when unset) and no card; a
GPU task books ``gpu_required`` cards at its per-card commitment — 100 % each for work
that takes whole cards (tensor-parallel replicas and all non-inference work), its
``gpu_memory_utilization`` for an inference replica on one shared card. So two
services at 50 % on one card are one card. Cards are counted in hundredths.

**What counts as held** (the services layer's read): every current task of every live
group of the tenant (``replaced_by`` empty), a rolling update's candidates while they
run beside the replicas they replace, whatever their state: a stopped or failed
service still holds its share, so a start or a recovery rebuild never needs a check;
deleting a service frees it. Replicas a scale-in took away (draining) no longer count.

**Only growth is checked.** A change is refused only on a quota it adds to; a tenant
over a quota an operator lowered may still scale down, update in place or delete.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.core.placement import DEFAULT_CPU_TASK_MEMORY_MB

# upper bounds an operator may set (the columns are 32-bit integers)
MAX_CARDS = 100_000
MAX_SERVICES = 100_000
MAX_REPLICAS = 1_000_000
MAX_CPU_MEMORY_MB = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Quota:
    """A tenant's limits; 0 = no limit."""

    cards: int = 0
    services: int = 0
    replicas: int = 0
    cpu_memory_mb: int = 0

    @property
    def limited(self) -> bool:
        return any((self.cards, self.services, self.replicas, self.cpu_memory_mb))


@dataclass(frozen=True, slots=True)
class Usage:
    """What a tenant holds, or what a change adds; cards in hundredths."""

    card_pct: int = 0
    services: int = 0
    replicas: int = 0
    cpu_memory_mb: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.card_pct + other.card_pct,
            self.services + other.services,
            self.replicas + other.replicas,
            self.cpu_memory_mb + other.cpu_memory_mb,
        )

    def times(self, n: int) -> Usage:
        return Usage(self.card_pct * n, self.services * n, self.replicas * n,
                     self.cpu_memory_mb * n)

    @property
    def cards(self) -> float:
        return self.card_pct / 100


def per_card_pct(gpu_required: int, task_type: str, gpu_memory_utilization: int) -> int:
    """The commitment a task books on each of its cards (``TaskDemand.per_card_pct``)."""
    whole = gpu_required > 1 or task_type != "inference"
    return 100 if whole else gpu_memory_utilization


def task_usage(
    *, gpu_required: int, task_type: str, gpu_memory_utilization: int, memory_mb: int
) -> Usage:
    """One task (one replica) as the scheduler books it."""
    if gpu_required <= 0:
        return Usage(replicas=1, cpu_memory_mb=memory_mb or DEFAULT_CPU_TASK_MEMORY_MB)
    pct = per_card_pct(gpu_required, task_type, gpu_memory_utilization)
    return Usage(card_pct=gpu_required * pct, replicas=1)


def new_service(per_task: Usage, tasks: int) -> Usage:
    """What a create adds: one service and its tasks."""
    return per_task.times(tasks) + Usage(services=1)


@dataclass(frozen=True, slots=True)
class Refusal:
    field: str  # the quota's name on the wire: quota_cards, quota_services...
    message: str


_UNITS = {
    "quota_cards": "cards",
    "quota_services": "services",
    "quota_replicas": "replicas",
    "quota_cpu_memory_mb": "MB of CPU memory",
}


def _amount(field: str, n: int) -> str:
    return f"{n / 100:g}" if field == "quota_cards" else str(n)


def _dimensions(q: Quota, u: Usage) -> list[tuple[str, int, int]]:
    """(field, limit in usage units, usage) per quota."""
    return [
        ("quota_cards", q.cards * 100, u.card_pct),
        ("quota_services", q.services, u.services),
        ("quota_replicas", q.replicas, u.replicas),
        ("quota_cpu_memory_mb", q.cpu_memory_mb, u.cpu_memory_mb),
    ]


def _reason(tenant: str, field: str, limit: int, have: int, want: int, doing: str) -> str:
    return (
        f"tenant {tenant!r} quota: {_amount(field, limit)} {_UNITS[field]}, "
        f"{_amount(field, have)} in use, {doing} needs {_amount(field, want)} ({field})"
    )


def check(
    tenant: str, quota: Quota, used: Usage, need: Usage, doing: str = "this"
) -> Refusal | None:
    """None when ``need`` fits beside ``used`` under every quota it adds to; else the
    first quota it breaks, e.g. "tenant 'team-a' quota: 4 cards, 3 in use, this needs
    2 (quota_cards)"."""
    for (field, limit, have), (_, _, want) in zip(
        _dimensions(quota, used), _dimensions(Quota(), need), strict=True
    ):
        if limit and want > 0 and have + want > limit:
            return Refusal(field, _reason(tenant, field, limit, have, want, doing))
    return None


def headroom(
    tenant: str, quota: Quota, used: Usage, per_replica: Usage
) -> tuple[int, Refusal] | None:
    """How many more replicas of ``per_replica`` fit, and the quota that stops them
    there (None: no quota limits them). Never negative: over a lowered quota it is 0."""
    best: tuple[int, Refusal] | None = None
    for (field, limit, have), (_, _, each) in zip(
        _dimensions(quota, used), _dimensions(Quota(), per_replica), strict=True
    ):
        if not limit or each <= 0:
            continue
        n = max(0, (limit - have) // each)
        if best is None or n < best[0]:
            why = _reason(tenant, field, limit, have, each, "each replica")
            best = (n, Refusal(field, why))
    return best
