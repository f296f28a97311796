"""The pure quota policy (N2, core/quotas.py): what a task counts, refusals naming the
quota, only growth checked, the autoscaler's headroom and its clamp."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from heteroflow.core.autoscale import Decision, ScalePolicy, decide
from heteroflow.core.placement import DEFAULT_CPU_TASK_MEMORY_MB, TaskDemand
from heteroflow.core.quotas import (
    Quota,
    Usage,
    check,
    headroom,
    new_service,
    per_card_pct,
    task_usage,
)


def gpu(n: int = 1, pct: int = 90, task_type: str = "inference") -> Usage:
    return task_usage(gpu_required=n, task_type=task_type, gpu_memory_utilization=pct,
                      memory_mb=0)


@pytest.mark.parametrize(
    ("gpus", "task_type", "pct"),
    [(1, "inference", 50), (1, "inference", 90), (2, "inference", 50), (4, "inference", 90),
     (1, "training", 50), (1, "container", 30), (8, "training", 90)],
)
def test_the_card_commitment_is_the_placements_own(gpus: int, task_type: str, pct: int) -> None:
    demand = TaskDemand(
        task_id="t", gpu_required=gpus, gpu_type="", gpu_memory_utilization=pct,
        estimated_gpu_memory_mb=0, memory_mb=0, host_ports=(), task_type=task_type,
    )
    assert per_card_pct(gpus, task_type, pct) == demand.per_card_pct


def test_what_a_task_counts() -> None:
    assert gpu(1, 50) == Usage(card_pct=50, replicas=1)  # half a shared card
    assert gpu(2, 50) == Usage(card_pct=200, replicas=1)  # tensor parallel: whole cards
    assert gpu(1, 50, "training") == Usage(card_pct=100, replicas=1)
    cpu = task_usage(gpu_required=0, task_type="inference", gpu_memory_utilization=90,
                     memory_mb=2048)
    assert cpu == Usage(replicas=1, cpu_memory_mb=2048)
    unset = task_usage(gpu_required=0, task_type="inference", gpu_memory_utilization=90,
                       memory_mb=0)
    assert unset.cpu_memory_mb == DEFAULT_CPU_TASK_MEMORY_MB  # what the scheduler books
    assert new_service(gpu(1, 50), 3) == Usage(card_pct=150, services=1, replicas=3)
    assert (gpu(1, 50) + gpu(1, 50)).cards == 1.0


@pytest.mark.feature("N2")
def test_a_refusal_names_the_quota_with_its_numbers() -> None:
    q = Quota(cards=4)
    used = Usage(card_pct=300, services=2, replicas=3)
    assert check("team-a", q, used, gpu(1, 100)) is None  # 4 of 4: fits exactly
    r = check("team-a", q, used, gpu(2, 90))
    assert r is not None and r.field == "quota_cards"
    assert r.message.startswith("tenant 'team-a' quota: 4 cards, 3 in use, this needs 2")
    # shared cards count their commitment: 3.5 in use, half a card more is too much
    r = check("team-a", q, Usage(card_pct=350), gpu(1, 60))
    assert r is not None and "4 cards, 3.5 in use, this needs 0.6" in r.message
    r = check("t", Quota(services=2), used, new_service(gpu(), 1), "this service")
    assert r is not None and r.field == "quota_services"
    assert "2 services, 2 in use, this service needs 1" in r.message
    r = check("t", Quota(replicas=4), used, gpu().times(2))
    assert r is not None and r.field == "quota_replicas"
    cpu = task_usage(gpu_required=0, task_type="inference", gpu_memory_utilization=90,
                     memory_mb=3000)
    r = check("t", Quota(cpu_memory_mb=4096), Usage(cpu_memory_mb=2048), cpu)
    assert r is not None and r.field == "quota_cpu_memory_mb"
    assert "4096 MB of CPU memory, 2048 in use, this needs 3000" in r.message


@pytest.mark.feature("N2")
def test_no_limit_and_only_growth_is_checked() -> None:
    huge = Usage(card_pct=10**6, services=10**4, replicas=10**5, cpu_memory_mb=10**7)
    assert check("t", Quota(), huge, huge) is None  # 0 = no limit
    # over a lowered quota: what adds nothing to it passes (a CPU task needs no card)
    cpu = task_usage(gpu_required=0, task_type="inference", gpu_memory_utilization=90,
                     memory_mb=0)
    assert check("t", Quota(cards=1), Usage(card_pct=400), cpu) is None
    assert check("t", Quota(cards=1), Usage(card_pct=400), Usage()) is None


@pytest.mark.feature("N2")
def test_headroom_is_the_tightest_quota() -> None:
    assert headroom("t", Quota(), Usage(), gpu()) is None
    room = headroom("t", Quota(cards=4, replicas=10), Usage(card_pct=180, replicas=2),
                    gpu(1, 90))
    assert room is not None and room[0] == 2 and room[1].field == "quota_cards"
    assert "4 cards, 1.8 in use, each replica needs 0.9" in room[1].message
    room = headroom("t", Quota(cards=40, replicas=3), Usage(card_pct=90, replicas=2), gpu())
    assert room is not None and room[0] == 1 and room[1].field == "quota_replicas"
    over = headroom("t", Quota(cards=1), Usage(card_pct=300), gpu())
    assert over is not None and over[0] == 0  # never negative
    # a quota a replica adds nothing to does not limit it
    cpu = task_usage(gpu_required=0, task_type="inference", gpu_memory_utilization=90,
                     memory_mb=0)
    assert headroom("t", Quota(cards=1), Usage(card_pct=300), cpu) is None


@pytest.mark.feature("N2")
def test_the_autoscaler_clamps_a_scale_out_to_the_quota_never_below_current() -> None:
    now = datetime(2026, 1, 1, tzinfo=UTC)

    def dec(current: int, value: float, quota: tuple[int, str]) -> Decision:
        return decide(policy=ScalePolicy(True, "inflight", 1), current=current, lo=1, hi=8,
                      value=value, replicas=[], now=now, quota=quota)

    d = dec(2, 3.0, (1, "tenant 't' quota: 3 cards"))
    assert (d.raw, d.desired) == (6, 3)
    assert d.key == "3:quota-clamped"
    assert "quota-clamped to 3: tenant 't' quota: 3 cards" in d.describe()
    d = dec(2, 3.0, (0, "full"))
    assert (d.desired, d.changes, d.key) == (2, False, "2:quota-clamped")
    # scaling in is not the quota's business
    d = dec(4, 0.5, (0, "full"))
    assert d.desired == 2 and not any(n.startswith("quota") for n in d.notes)
    # room enough: no note
    d = dec(2, 2.0, (5, "room"))
    assert (d.desired, d.notes) == (4, ())
