"""N2: a tenant's token quota at the gateway, counted beside each key's own (M8) quota."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.policy.limits import (
    OK,
    QUOTA,
    REQUESTS,
    TENANT_QUOTA,
    Charge,
    KeyState,
    Limiter,
    QuotaCounter,
    TenantCharge,
    Ticket,
    admit,
    quota_period,
    refusal,
    refusal_headers,
    settle,
)
from heteroflow.gateway.routing.store import MemoryStore
from heteroflow.gateway.wire import errors
from heteroflow.schemas.routing import KeyEntry, RoutingSnapshot

T0 = datetime(2026, 12, 1, 23, 0, tzinfo=UTC).timestamp() * 1000.0
EMB = "/v1/embeddings"  # cost = body bytes / 4: 40 bytes cost 10 tokens


def charge(
    endpoint: str = "ep-a",
    *,
    rpm: int = 0,
    quota: int = 0,
    tenant_quota: int = 0,
    cost: int = 0,
    now: float = T0,
) -> Charge:
    period, end = quota_period("day", now) if quota else ("", 0.0)
    tenant = None
    if tenant_quota:
        tenant = TenantCharge("tn-1", tenant_quota, *quota_period("day", now))
    return Charge(endpoint, rpm, 0, quota, period, end, 0, cost, tenant)


def entry(endpoint: str = "ep-a", tenant_tokens: int = 20, **kw: int | str) -> KeyEntry:
    return KeyEntry(
        endpoint,
        "tn-1",
        None,
        frozenset({"m"}),
        tenant_quota_tokens=tenant_tokens,
        tenant_quota_period="day",
        **kw,  # type: ignore[arg-type]
    )


Refusal = tuple[errors.OpenAIError, list[tuple[bytes, bytes]]]


def take(limiter: Limiter, e: KeyEntry, used: int | None = 10) -> Ticket | Refusal:
    """One embeddings request of 10 reserved tokens; an admitted one is settled at ``used``."""
    t = asyncio.run(limiter.admit(e, EMB, {}, 40))
    if isinstance(t, Ticket):
        limiter.settle(t, 200, used)
    return t


@pytest.mark.feature("N2")
def test_the_tenant_quota_refuses_while_the_key_quota_still_has_room() -> None:
    st_, tenant = KeyState.new(), QuotaCounter()
    c = charge(quota=1000, tenant_quota=100, cost=60)
    assert admit(st_, c, T0, tenant).verdict == OK
    assert admit(st_, c, T0, tenant).verdict == OK  # 60 < 100: passes, overshoots to 120
    a = admit(st_, c, T0, tenant)
    assert a.verdict == TENANT_QUOTA and a.retry_after_ms == 3_600_000  # to 24:00 UTC
    assert (st_.used, tenant.used) == (120, 120)  # the refusal took nothing from either
    err = refusal(c, a)
    assert (err.status, err.type, err.code) == (429, "insufficient_quota", "insufficient_quota")
    assert err.message == (
        "You exceeded your tenant's token quota of 100 tokens per day; "
        "it resets at 2026-12-02T00:00:00Z."
    )
    assert dict(refusal_headers(c, a))[b"retry-after"] == b"3600"


@pytest.mark.feature("N2")
def test_the_key_quota_refuses_first_and_takes_nothing_from_the_tenant() -> None:
    st_, tenant = KeyState.new(), QuotaCounter()
    c = charge(quota=50, tenant_quota=1000, cost=60)
    assert admit(st_, c, T0, tenant).verdict == OK
    a = admit(st_, c, T0, tenant)
    assert a.verdict == QUOTA and tenant.used == 60
    assert refusal(c, a).message.startswith("You exceeded your current quota of 50 tokens")
    # another key of the tenant still passes: only this key's quota is spent
    other = charge("ep-b", tenant_quota=1000, cost=60)
    assert admit(KeyState.new(), other, T0, tenant).verdict == OK
    assert tenant.used == 120


@pytest.mark.feature("N2")
def test_a_refusal_by_another_limit_takes_nothing_from_the_tenant() -> None:
    st_, tenant = KeyState.new(), QuotaCounter()
    c = charge(rpm=1, tenant_quota=1000, cost=30)
    assert admit(st_, c, T0, tenant).verdict == OK
    assert admit(st_, c, T0, tenant).verdict == REQUESTS
    assert tenant.used == 30


@pytest.mark.feature("N2")
def test_settling_corrects_the_tenant_counter_within_its_period() -> None:
    st_, tenant = KeyState.new(), QuotaCounter()
    c = charge(quota=1000, tenant_quota=100, cost=90)
    assert admit(st_, c, T0, tenant).verdict == OK
    settle(st_, c, 0, 10 - 90, T0, tenant)  # the answer used 10 of the 90 reserved
    assert (st_.used, tenant.used) == (10, 10)
    settle(st_, c, 0, -500, T0, tenant)  # never below zero
    assert tenant.used == 0
    # a correction arriving after the period rolled over leaves the new period alone
    nxt = T0 + 3_600_000
    assert admit(st_, charge(tenant_quota=100, cost=5, now=nxt), nxt, tenant).verdict == OK
    settle(st_, c, 0, -90, nxt, tenant)
    assert tenant.used == 5


@pytest.mark.feature("N2")
def test_two_keys_of_one_tenant_share_its_budget_and_each_keeps_its_own() -> None:
    limiter = Limiter(MemoryStore(), FakeClock(datetime(2026, 12, 1, 12, tzinfo=UTC)))
    a, b = entry("ep-a", quota_tokens=1000, quota_period="day"), entry("ep-b")
    assert isinstance(take(limiter, a), Ticket)  # tenant 10
    assert isinstance(take(limiter, b), Ticket)  # tenant 20: spent
    for e in (a, b):
        refused = take(limiter, e)
        assert not isinstance(refused, Ticket)
        assert refused[0].code == "insufficient_quota"
        assert "tenant's token quota of 20 tokens per day" in refused[0].message
        assert dict(refused[1])[b"retry-after"] == b"43200"  # 12:00 -> 24:00 UTC
    # a key of another tenant is not affected
    other = KeyEntry("ep-c", "tn-2", None, frozenset({"m"}))
    assert isinstance(take(limiter, other), Ticket)


@pytest.mark.feature("N2")
def test_answers_are_charged_to_the_tenant_and_failures_refunded() -> None:
    limiter = Limiter(MemoryStore(), FakeClock(datetime(2026, 12, 1, 12, tzinfo=UTC)))
    a, b = entry("ep-a", tenant_tokens=25), entry("ep-b", tenant_tokens=25)
    t = asyncio.run(limiter.admit(a, EMB, {}, 40))
    assert isinstance(t, Ticket) and t.charge.tenant is not None
    assert t.charge.tenant.period == "d20261201"
    limiter.settle(t, 502, None)  # nothing generated: the reservation goes back
    assert isinstance(take(limiter, a, used=2), Ticket)  # tenant 2
    assert isinstance(take(limiter, b, used=2), Ticket)  # tenant 4
    assert isinstance(take(limiter, a, used=20), Ticket)  # tenant 24 < 25
    assert isinstance(take(limiter, b, used=None), Ticket)  # unknown usage keeps 10: 34
    assert not isinstance(take(limiter, a), Ticket)


@pytest.mark.feature("N2")
def test_the_tenant_period_rolls_over_with_the_injected_clock() -> None:
    clock = FakeClock(datetime(2026, 1, 31, 23, 59, tzinfo=UTC))
    limiter = Limiter(MemoryStore(), clock)
    daily = entry("ep-a", tenant_tokens=10)
    assert isinstance(take(limiter, daily), Ticket)
    refused = take(limiter, daily)
    assert not isinstance(refused, Ticket)
    assert "resets at 2026-02-01T00:00:00Z" in refused[0].message
    assert dict(refused[1])[b"retry-after"] == b"60"
    clock.advance(60)
    t = take(limiter, daily)
    assert isinstance(t, Ticket) and t.charge.tenant is not None
    assert t.charge.tenant.period == "d20260201"
    # a monthly tenant quota lasts until the calendar month ends
    monthly = KeyEntry(
        "ep-m", "tn-m", None, frozenset(), tenant_quota_tokens=10, tenant_quota_period="month"
    )
    assert isinstance(take(limiter, monthly), Ticket)
    clock.advance(27 * 86400)  # 2026-02-28
    assert not isinstance(take(limiter, monthly), Ticket)
    clock.advance(86400)  # 2026-03-01
    assert isinstance(take(limiter, monthly), Ticket)


@pytest.mark.feature("N2")
def test_a_tenant_quota_without_a_valid_period_is_no_quota() -> None:
    limiter = Limiter(MemoryStore(), FakeClock())
    e = KeyEntry(
        "ep-w", "tn-w", None, frozenset(), tenant_quota_tokens=1, tenant_quota_period="week"
    )
    for _ in range(3):
        assert isinstance(take(limiter, e), Ticket)


@pytest.mark.feature("N2")
def test_tenant_quotas_travel_once_per_tenant_and_older_snapshots_have_none() -> None:
    keys = {
        "h1": entry("ep-a", tenant_tokens=500, rpm_limit=5),
        "h2": entry("ep-b", tenant_tokens=500),
        "h3": KeyEntry("ep-c", "tn-2", None, frozenset({"m"})),
    }
    wire = RoutingSnapshot(version=2, keys=keys).to_wire()
    assert wire["tenant_quotas"] == {"tn-1": {"quota_tokens": 500, "quota_period": "day"}}
    assert "tenant_quota_tokens" not in wire["keys"]["h1"]  # not repeated per key
    assert RoutingSnapshot.from_wire(wire).keys == keys
    # an older server's snapshot: no tenant_quotas, so no tenant limit at all
    del wire["tenant_quotas"]
    old = RoutingSnapshot.from_wire(wire)
    assert {(k.tenant_quota_tokens, k.tenant_quota_period) for k in old.keys.values()} == {
        (0, "")
    }
    limiter = Limiter(MemoryStore(), FakeClock())
    for _ in range(3):
        assert isinstance(take(limiter, old.keys["h2"], used=1000), Ticket)
    # no tenant with a quota: the key is left out, as before
    assert "tenant_quotas" not in RoutingSnapshot(version=1, keys={"h3": keys["h3"]}).to_wire()


@pytest.mark.feature("N2")
def test_a_changed_tenant_quota_applies_to_the_next_request() -> None:
    """A new snapshot may raise, lower or re-period the quota mid-period."""
    limiter = Limiter(MemoryStore(), FakeClock(datetime(2026, 12, 1, 12, tzinfo=UTC)))
    assert isinstance(take(limiter, entry(tenant_tokens=10)), Ticket)  # tenant 10
    assert not isinstance(take(limiter, entry(tenant_tokens=10)), Ticket)
    assert isinstance(take(limiter, entry(tenant_tokens=15)), Ticket)  # raised: 20
    refused = take(limiter, entry(tenant_tokens=15))
    assert not isinstance(refused, Ticket) and "of 15 tokens per day" in refused[0].message
    monthly = KeyEntry(
        "ep-a", "tn-1", None, frozenset(), tenant_quota_tokens=15, tenant_quota_period="month"
    )
    t = take(limiter, monthly)  # a month's counter of its own
    assert isinstance(t, Ticket) and t.charge.tenant is not None
    assert (t.charge.tenant.period, t.charge.tenant.quota) == ("m202612", 15)
