"""Per-key rate limits and the quota circuit breaker (M8): the pure policy and its glue.

Window type: every per-minute limit is a **leaky bucket** (the token bucket / GCRA family):
its level is what was taken, it drains continuously at ``limit`` per 60 s, a request is
admitted when ``level + cost <= limit``. At a standstill exactly ``limit`` requests (or
tokens) pass, then one more every ``60 s / limit`` — no fixed-window edge where twice the
limit passes in a second, and ``retry-after`` is the exact wait, not "the next minute".
Over any 60 s span at most ``2 * limit`` can pass (a full bucket plus one minute of
drain), as with every token bucket.

* RPM: cost 1, taken atomically at admission: exact, across instances too (one Redis
  script checks and takes).
* TPM: the admission reserves ``prompt estimate + max_tokens * n`` (capped at the limit,
  so a request larger than the whole budget waits for a full bucket instead of never
  passing); when the answer ends the bucket is corrected by ``real - reserved`` (both
  ways). The bucket can therefore exceed the limit by at most the sum of under-estimates
  of the requests in flight (a request whose real usage exceeds its reservation — only
  possible with no ``max_tokens`` — or an answer whose usage is unknown, which keeps its
  reservation: an over-estimate, never an overshoot).
* Quota (circuit breaker): ``quota_tokens`` per UTC calendar day or month; requests pass
  while the period's counter is below the quota, each reserves its cost and is corrected
  at the end; once spent, ``429 insufficient_quota`` until the period ends.
* Tenant quota (N2): the same breaker over the key's tenant (``KeyEntry.tenant_quota_*``),
  one counter shared by all the tenant's keys: checked after the key's quota, charged
  the same reservation and corrected by the same real usage, so an answer's tokens count
  against both. Its refusal is the same 429 naming the tenant's quota.

Everything here is pure (time is a parameter in ms since the epoch); the stores in
``gateway.store`` keep the state — in memory, or in Redis where a Lua script runs the
same arithmetic (``store.ADMIT_LUA``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from heteroflow.core.clock import Clock
from heteroflow.gateway.wire import errors
from heteroflow.schemas.routing import KeyEntry

WINDOW_MS = 60_000.0
# Float slack: a bucket filled by exactly ``limit`` unit costs must still pass.
EPS = 1e-6
# Completion tokens reserved when the request names no max_tokens (OpenAI's legacy
# completions default to 16; a chat answer is charged its real size afterwards).
DEFAULT_MAX_TOKENS = {
    "/v1/chat/completions": 1024,
    "/v1/completions": 16,
    "/v1/responses": 1024,  # M14: a chat completion underneath
}
PERIODS = ("day", "month")

# Verdicts; the Redis script returns the same numbers.
OK = 0
QUOTA = 1
REQUESTS = 2
TOKENS = 3
TENANT_QUOTA = 4


@dataclass(slots=True)
class Bucket:
    """A leaky bucket's state: ``level`` taken, as of ``at_ms``."""

    level: float = 0.0
    at_ms: float = 0.0

    def level_at(self, limit: int, now_ms: float) -> float:
        if self.level <= 0.0:
            return 0.0
        drained = (now_ms - self.at_ms) * limit / WINDOW_MS
        if drained <= 0.0:
            return self.level
        return max(0.0, self.level - drained)

    def set(self, level: float, now_ms: float) -> None:
        self.level = max(0.0, level)
        self.at_ms = now_ms


@dataclass(slots=True)
class KeyState:
    """One key's limit state (in memory; Redis keeps the same fields)."""

    requests: Bucket
    tokens: Bucket
    period: str = ""  # the quota period ``used`` belongs to
    used: int = 0

    @classmethod
    def new(cls) -> KeyState:
        return cls(Bucket(), Bucket())


@dataclass(slots=True)
class QuotaCounter:
    """A tenant's quota counter (in memory; Redis keeps one key per tenant and period)."""

    period: str = ""
    used: int = 0


@dataclass(frozen=True, slots=True)
class Admission:
    """A store's answer; remaining/reset describe the buckets after this request."""

    verdict: int
    retry_after_ms: int = 0
    requests_remaining: int = 0
    requests_reset_ms: int = 0
    tokens_remaining: int = 0
    tokens_reset_ms: int = 0
    used: int = 0  # the quota counter (before this request)
    shared: bool = True  # False: decided by a local fallback (Redis unreachable)


@dataclass(frozen=True, slots=True)
class TenantCharge:
    """The key's tenant's token quota (N2), charged ``Charge.quota_cost`` as well."""

    tenant_id: str
    quota: int
    period: str  # quota period id
    period_end_ms: float


@dataclass(frozen=True, slots=True)
class Charge:
    """What one admission asks of a key's limits."""

    endpoint_id: str
    rpm: int
    tpm: int
    quota: int
    period: str  # quota period id ("" without a quota)
    period_end_ms: float
    tokens_cost: int  # reserved in the TPM bucket (capped at tpm)
    quota_cost: int  # reserved against the quota (the key's and the tenant's)
    tenant: TenantCharge | None = None  # N2: None when the key's tenant has no quota


def _remaining(limit: int, level: float) -> int:
    return max(0, math.floor(limit - level + EPS))


def _reset_ms(limit: int, level: float) -> int:
    return math.ceil(level * WINDOW_MS / limit - EPS) if level > 0.0 else 0


def _wait_ms(limit: int, level: float, cost: int) -> int:
    return max(1, math.ceil((level + cost - limit) * WINDOW_MS / limit - EPS))


def admit(
    state: KeyState, c: Charge, now_ms: float, tenant: QuotaCounter | None = None
) -> Admission:
    """Check every limit; take from all of them only when all pass. ``tenant``: the
    counter of the key's tenant, needed when ``c.tenant``."""
    if c.quota:
        if state.period != c.period:
            state.period, state.used = c.period, 0
        if state.used >= c.quota:
            return Admission(QUOTA, max(1, math.ceil(c.period_end_ms - now_ms)), used=state.used)
    tc = c.tenant
    if tc is not None:
        assert tenant is not None
        if tenant.period != tc.period:
            tenant.period, tenant.used = tc.period, 0
        if tenant.used >= tc.quota:
            wait = max(1, math.ceil(tc.period_end_ms - now_ms))
            return Admission(TENANT_QUOTA, wait, used=state.used if c.quota else 0)
    rl = state.requests.level_at(c.rpm, now_ms) if c.rpm else 0.0
    tl = state.tokens.level_at(c.tpm, now_ms) if c.tpm else 0.0
    verdict, retry = OK, 0
    if c.rpm and rl + 1 > c.rpm + EPS:
        verdict, retry = REQUESTS, _wait_ms(c.rpm, rl, 1)
    elif c.tpm and tl + c.tokens_cost > c.tpm + EPS:
        verdict, retry = TOKENS, _wait_ms(c.tpm, tl, c.tokens_cost)
    used = state.used if c.quota else 0
    if verdict == OK:
        if c.rpm:
            rl += 1
            state.requests.set(rl, now_ms)
        if c.tpm:
            tl += c.tokens_cost
            state.tokens.set(tl, now_ms)
        if c.quota:
            state.used += c.quota_cost
        if tenant is not None and tc is not None:
            tenant.used += c.quota_cost
    return Admission(
        verdict,
        retry,
        _remaining(c.rpm, rl) if c.rpm else 0,
        _reset_ms(c.rpm, rl) if c.rpm else 0,
        _remaining(c.tpm, tl) if c.tpm else 0,
        _reset_ms(c.tpm, tl) if c.tpm else 0,
        used,
    )


def settle(
    state: KeyState,
    c: Charge,
    tokens_delta: int,
    quota_delta: int,
    now_ms: float,
    tenant: QuotaCounter | None = None,
) -> None:
    """Correct the reservations by ``real - reserved`` once the answer has ended (the
    quota's in the key's counter and in its tenant's, each within its own period)."""
    if c.tpm and tokens_delta:
        state.tokens.set(state.tokens.level_at(c.tpm, now_ms) + tokens_delta, now_ms)
    if c.quota and quota_delta and state.period == c.period:
        state.used = max(0, state.used + quota_delta)
    tc = c.tenant
    if tenant is not None and tc is not None and quota_delta and tenant.period == tc.period:
        tenant.used = max(0, tenant.used + quota_delta)


def quota_period(period: str, now_ms: float) -> tuple[str, float]:
    """The UTC calendar period holding ``now_ms``: its id and its end (ms)."""
    now = datetime.fromtimestamp(now_ms / 1000.0, UTC)
    if period == "day":
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        end = start + timedelta(days=1)
        pid = f"d{start:%Y%m%d}"
    else:
        start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (start + timedelta(days=32)).replace(day=1)
        pid = f"m{start:%Y%m}"
    return pid, end.timestamp() * 1000.0


def request_cost(path: str, body: dict[str, Any], body_len: int) -> int:
    """Tokens a request may use: prompt estimate (bytes / 4, an over-estimate) + output."""
    prompt = (body_len + 3) // 4
    if path == "/v1/embeddings":
        return prompt
    out = _count(body.get("max_completion_tokens"))
    if out is None:
        out = _count(body.get("max_tokens"))
        if out is None:
            out = DEFAULT_MAX_TOKENS.get(path, 0)
    return prompt + out * max(1, _count(body.get("n")) or 1)


def _count(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def format_duration(ms: int) -> str:
    """OpenAI's spelling of x-ratelimit-reset-*: ``120ms``, ``1.5s``, ``6m0s``."""
    if ms < 1000:
        return f"{ms}ms"
    if ms < 60_000:
        return f"{ms / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    minutes, rest = divmod(ms, 60_000)
    return f"{minutes}m{rest // 1000}s"


def rate_headers(c: Charge, a: Admission) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-* headers for the limits this key has."""
    out: list[tuple[bytes, bytes]] = []
    if c.rpm:
        out += [
            (b"x-ratelimit-limit-requests", str(c.rpm).encode()),
            (b"x-ratelimit-remaining-requests", str(a.requests_remaining).encode()),
            (b"x-ratelimit-reset-requests", format_duration(a.requests_reset_ms).encode()),
        ]
    if c.tpm:
        out += [
            (b"x-ratelimit-limit-tokens", str(c.tpm).encode()),
            (b"x-ratelimit-remaining-tokens", str(a.tokens_remaining).encode()),
            (b"x-ratelimit-reset-tokens", format_duration(a.tokens_reset_ms).encode()),
        ]
    return out


def refusal(c: Charge, a: Admission) -> errors.OpenAIError:
    """The 429 for a refused admission, worded like OpenAI's."""
    wait = format_duration(a.retry_after_ms)
    if a.verdict == QUOTA:
        return quota_refusal("current quota", c.quota, c.period, c.period_end_ms)
    if a.verdict == TENANT_QUOTA and c.tenant is not None:
        t = c.tenant
        return quota_refusal("tenant's token quota", t.quota, t.period, t.period_end_ms)
    if a.verdict == REQUESTS:
        kind, what, limit, left, asked = "requests", "RPM", c.rpm, a.requests_remaining, 1
    else:
        kind, what, limit, left, asked = "tokens", "TPM", c.tpm, a.tokens_remaining, c.tokens_cost
    return errors.OpenAIError(
        429,
        f"Rate limit reached for {kind} per min ({what}): Limit {limit}, "
        f"Used {limit - left}, Requested {asked}. Please try again in {wait}.",
        kind,
        None,
        "rate_limit_exceeded",
    )


def quota_refusal(what: str, quota: int, period: str, end_ms: float) -> errors.OpenAIError:
    """The 429 of a spent quota, the key's or its tenant's (``what`` names which)."""
    end = datetime.fromtimestamp(end_ms / 1000.0, UTC)
    word = "day" if period.startswith("d") else "month"
    return errors.OpenAIError(
        429,
        f"You exceeded your {what} of {quota} tokens per {word}; "
        f"it resets at {end:%Y-%m-%dT%H:%M:%SZ}.",
        "insufficient_quota",
        None,
        "insufficient_quota",
    )


def refusal_headers(c: Charge, a: Admission) -> list[tuple[bytes, bytes]]:
    secs = max(1, math.ceil(a.retry_after_ms / 1000))
    return [
        (b"retry-after", str(secs).encode()),
        (b"retry-after-ms", str(a.retry_after_ms).encode()),
        *rate_headers(c, a),
    ]


class LimitStore(Protocol):
    """Where limit state lives: this process (``MemoryStore``) or Redis (``RedisStore``)."""

    async def admit(self, c: Charge, now_ms: float) -> Admission: ...

    def settle(
        self, c: Charge, tokens_delta: int, quota_delta: int, now_ms: float, shared: bool
    ) -> None:
        """Apply a correction; may be batched (it is off the request path)."""


class Ticket:
    """An admitted request: the headers to add, and the reservation to correct later."""

    __slots__ = ("admission", "charge", "headers")

    def __init__(self, charge: Charge, admission: Admission) -> None:
        self.charge = charge
        self.admission = admission
        self.headers = rate_headers(charge, admission)


class Limiter:
    """Turns a request into a ``Charge``, asks the store, and settles the answer."""

    def __init__(self, store: LimitStore, clock: Clock) -> None:
        self._store = store
        self._clock = clock
        self._periods: dict[str, tuple[str, float]] = {}  # period kind -> (id, end_ms)
        # N2: tenant id -> (period kind, the charge of its tenant quota this period)
        self._tenants: dict[str, tuple[str, TenantCharge]] = {}

    def _now_ms(self) -> float:
        return self._clock.now().timestamp() * 1000.0

    def _period(self, kind: str, now_ms: float) -> tuple[str, float]:
        cached = self._periods.get(kind)
        if cached is None or now_ms >= cached[1]:
            cached = self._periods[kind] = quota_period(kind, now_ms)
        return cached

    def _tenant(self, entry: KeyEntry, now_ms: float) -> TenantCharge | None:
        """What this key's tenant quota is charged: one object per tenant and period."""
        kind = entry.tenant_quota_period
        if not entry.tenant_quota_tokens or kind not in PERIODS:
            return None
        cached = self._tenants.get(entry.tenant_id)
        if (
            cached is None
            or now_ms >= cached[1].period_end_ms
            or cached[0] != kind
            or cached[1].quota != entry.tenant_quota_tokens
        ):
            period, end = quota_period(kind, now_ms)
            t = TenantCharge(entry.tenant_id, entry.tenant_quota_tokens, period, end)
            cached = self._tenants[entry.tenant_id] = (kind, t)
        return cached[1]

    async def admit(
        self, entry: KeyEntry, path: str, body: dict[str, Any], body_len: int
    ) -> Ticket | tuple[errors.OpenAIError, list[tuple[bytes, bytes]]]:
        now = self._now_ms()
        quota = entry.quota_tokens if entry.quota_period in PERIODS else 0
        tenant = self._tenant(entry, now)
        cost = request_cost(path, body, body_len) if entry.tpm_limit or quota or tenant else 0
        period, end = self._period(entry.quota_period, now) if quota else ("", 0.0)
        charge = Charge(
            entry.endpoint_id,
            entry.rpm_limit,
            entry.tpm_limit,
            quota,
            period,
            end,
            min(cost, entry.tpm_limit),
            cost,
            tenant,
        )
        a = await self._store.admit(charge, now)
        if a.verdict != OK:
            return refusal(charge, a), refusal_headers(charge, a)
        return Ticket(charge, a)

    def settle(self, ticket: Ticket, status: int | None, used_tokens: int | None) -> None:
        """``status`` None or >= 400: nothing was generated, the reservation is returned;
        a success whose usage is unknown keeps its reservation."""
        c = ticket.charge
        if not (c.tpm or c.quota or c.tenant):
            return
        if status is None or status >= 400:
            used = 0
        elif used_tokens is None:
            return
        else:
            used = used_tokens
        self._store.settle(
            c,
            used - c.tokens_cost,
            used - c.quota_cost,
            self._now_ms(),
            ticket.admission.shared,
        )
