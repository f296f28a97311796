"""Where the gateway's limit and idempotency state lives: this process, or Redis.

``MemoryStore`` serves a single gateway instance. ``RedisStore`` is shared by several:
each admission is one Lua script (one round trip) that checks and takes every limit of
the key atomically, with the same arithmetic as ``limits.admit``; corrections after the
answer (``settle``) are summed per key and sent in one pipeline every 50 ms, off the
request path. Idempotency records are claimed with one script and stored with one SET.

Keys: ``{prefix}rl:{<endpoint>}:r|t`` (the buckets, hashes ``l`` level / ``t`` ms),
``{prefix}rl:{<endpoint>}:q:<period>`` (the quota counter, expiring an hour after its
period) and ``{prefix}idem:{<endpoint>}:<key>``; the braces keep one endpoint's keys in
one Redis Cluster slot, as multi-key scripts need. A tenant with a token quota (N2) adds
``{prefix}rlt:{<tenant>}:q:<period>`` (its counter, expiring like the key's), checked
and taken by the same admission script and corrected by the same settle script as its
key's (so still one round trip; that script then spans two slots — this client talks
to one Redis, not to a Cluster).

Redis unreachable: **fail open to this instance's memory**. Limits are then enforced
per instance (so a key gets at most ``instances * limit`` during the outage), idempotency
keys hold per instance, and no request fails because of Redis. Redis is retried one
second after a failure; each change of state is logged once, never per request.
Instances' clocks must be NTP-synced: a skew of d seconds lets ``d * limit / 60`` extra
requests through a bucket.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol
from urllib.parse import urlsplit

from heteroflow.gateway.policy import limits
from heteroflow.gateway.policy.idempotency import (
    IN_FLIGHT,
    MISMATCH,
    PROCEED,
    REPLAY,
    Claim,
    IdempotencyStore,
    MemoryTable,
    StoredResponse,
    new_token,
)
from heteroflow.gateway.policy.limits import (
    Admission,
    Charge,
    KeyState,
    LimitStore,
    QuotaCounter,
    TenantCharge,
)
from heteroflow.gateway.wire.redis_wire import RedisWire, ReplyError, Script

logger = logging.getLogger(__name__)

_LEVEL_LUA = """
local W = 60000
local EPS = 1e-6
local function level(key, limit, now)
  if limit <= 0 then return 0 end
  local v = redis.call('HMGET', key, 'l', 't')
  local l = tonumber(v[1])
  if not l or l <= 0 then return 0 end
  local d = (now - tonumber(v[2])) * limit / W
  if d <= 0 then return l end
  l = l - d
  if l < 0 then return 0 end
  return l
end
local function put(key, limit, l, now)
  if l < 0 then l = 0 end
  redis.call('HSET', key, 'l', string.format('%.17g', l), 't', string.format('%.17g', now))
  redis.call('PEXPIRE', key, string.format('%d', math.ceil(l * W / limit) + 1000))
  return l
end
"""

# KEYS: requests bucket, tokens bucket, quota counter[, tenant quota counter].
# ARGV[1]: "now_ms rpm tpm quota tokens_cost quota_cost period_end_ms[ tquota tperiod_end_ms]".
# Returns "verdict retry_ms req_remaining req_reset_ms tok_remaining tok_reset_ms used".
# (One argument in, one string out: packing and parsing them is most of a call's CPU.)
ADMIT_LUA = (
    _LEVEL_LUA
    + """
local a = {}
for x in string.gmatch(ARGV[1], '%S+') do a[#a + 1] = tonumber(x) end
local now, rpm, tpm, quota, tcost, qcost, pend = a[1], a[2], a[3], a[4], a[5], a[6], a[7]
local tquota, tpend = a[8] or 0, a[9] or 0
local function out(...)
  return string.format('%d %d %d %d %d %d %d', ...)
end
local function remaining(limit, l)
  if limit <= 0 then return 0 end
  local r = math.floor(limit - l + EPS)
  if r < 0 then return 0 end
  return r
end
local function reset(limit, l)
  if limit <= 0 or l <= 0 then return 0 end
  return math.ceil(l * W / limit - EPS)
end
-- a quota counter takes the reservation; a new one expires an hour after its period
local function count(key, period_end)
  if redis.call('INCRBY', key, qcost) == qcost then
    redis.call('PEXPIRE', key, string.format('%d', math.ceil(period_end - now) + 3600000))
  end
end
local function wait(limit, l, cost)
  local w = math.ceil((l + cost - limit) * W / limit - EPS)
  if w < 1 then return 1 end
  return w
end
local used = 0
if quota > 0 then
  used = tonumber(redis.call('GET', KEYS[3]) or '0')
  if used >= quota then
    local w = math.ceil(pend - now)
    if w < 1 then w = 1 end
    return out(1, w, 0, 0, 0, 0, used)
  end
end
if tquota > 0 then
  local tused = tonumber(redis.call('GET', KEYS[4]) or '0')
  if tused >= tquota then
    local w = math.ceil(tpend - now)
    if w < 1 then w = 1 end
    return out(4, w, 0, 0, 0, 0, used)
  end
end
local rl = level(KEYS[1], rpm, now)
local tl = level(KEYS[2], tpm, now)
local verdict, retry = 0, 0
if rpm > 0 and rl + 1 > rpm + EPS then
  verdict, retry = 2, wait(rpm, rl, 1)
elseif tpm > 0 and tl + tcost > tpm + EPS then
  verdict, retry = 3, wait(tpm, tl, tcost)
end
if verdict == 0 then
  if rpm > 0 then rl = put(KEYS[1], rpm, rl + 1, now) end
  if tpm > 0 then tl = put(KEYS[2], tpm, tl + tcost, now) end
  if quota > 0 then count(KEYS[3], pend) end
  if tquota > 0 then count(KEYS[4], tpend) end
end
return out(verdict, retry, remaining(rpm, rl), reset(rpm, rl), remaining(tpm, tl),
           reset(tpm, tl), used)
"""
)

# KEYS: tokens bucket, quota counter[, tenant quota counter].
# ARGV: now_ms, tpm, tokens_delta, quota_delta[, tenant_quota_delta].
SETTLE_LUA = (
    _LEVEL_LUA
    + """
local now, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local td, qd = tonumber(ARGV[3]), tonumber(ARGV[4])
if tpm > 0 and td ~= 0 then put(KEYS[1], tpm, level(KEYS[1], tpm, now) + td, now) end
local function correct(key, d)
  if d ~= 0 and redis.call('EXISTS', key) == 1 then
    if redis.call('INCRBY', key, d) < 0 then redis.call('SET', key, 0, 'KEEPTTL') end
  end
end
correct(KEYS[2], qd)
if KEYS[3] then correct(KEYS[3], tonumber(ARGV[5])) end
return 0
"""
)

# KEYS: the record. ARGV: fingerprint (64 hex), token, lease_ms.
# The record is 'p' .. fp .. token while in flight, 'd' .. fp .. packed response when done.
CLAIM_LUA = """
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], 'p' .. ARGV[1] .. ARGV[2], 'PX', ARGV[3])
  return {0}
end
if string.sub(v, 2, 65) ~= ARGV[1] then return {2} end
if string.sub(v, 1, 1) == 'p' then return {1} end
return {3, string.sub(v, 66)}
"""

RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

_ADMIT = Script(ADMIT_LUA)
_SETTLE = Script(SETTLE_LUA)
_CLAIM = Script(CLAIM_LUA)
_RELEASE = Script(RELEASE_LUA)
_REDIS_ERRORS = (ReplyError, OSError, TimeoutError, ValueError)


class GatewayStore(LimitStore, IdempotencyStore, Protocol):
    async def aclose(self) -> None: ...


class MemoryStore:
    """Single instance: plain dicts, the pure policy, no I/O."""

    def __init__(self, idempotency: MemoryTable | None = None) -> None:
        self._states: dict[str, KeyState] = {}
        self._tenants: dict[str, QuotaCounter] = {}  # N2: tenant id -> its quota counter
        self._table = idempotency or MemoryTable()

    async def admit(self, c: Charge, now_ms: float) -> Admission:
        st = self._states.get(c.endpoint_id)
        if st is None:
            st = self._states[c.endpoint_id] = KeyState.new()
        tenant = None
        if c.tenant is not None:
            tenant = self._tenants.get(c.tenant.tenant_id)
            if tenant is None:
                tenant = self._tenants[c.tenant.tenant_id] = QuotaCounter()
        return limits.admit(st, c, now_ms, tenant)

    def settle(
        self, c: Charge, tokens_delta: int, quota_delta: int, now_ms: float, shared: bool
    ) -> None:
        st = self._states.get(c.endpoint_id)
        if st is not None:
            tenant = None if c.tenant is None else self._tenants.get(c.tenant.tenant_id)
            limits.settle(st, c, tokens_delta, quota_delta, now_ms, tenant)

    async def claim(
        self, endpoint_id: str, key: bytes, fp: bytes, lease_ms: int, now_ms: float
    ) -> Claim:
        return self._table.claim(endpoint_id, key, fp, lease_ms, now_ms)

    async def complete(
        self,
        endpoint_id: str,
        key: bytes,
        fp: bytes,
        packed: bytes,
        ttl_ms: int,
        now_ms: float,
        shared: bool,
    ) -> None:
        self._table.complete(endpoint_id, key, fp, packed, ttl_ms, now_ms)

    async def release(
        self, endpoint_id: str, key: bytes, fp: bytes, token: bytes, shared: bool
    ) -> None:
        self._table.release(endpoint_id, key, fp, token)

    async def aclose(self) -> None:
        return None


def redacted(url: str) -> str:
    """host:port/db of a Redis URL: never the password."""
    parts = urlsplit(url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 6379}{parts.path}"


class RedisStore:
    """Shared by every gateway instance on one Redis (``redis_wire``: one pipelined
    connection per event loop)."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "hf:",
        timeout_s: float = 0.5,
        retry_s: float = 1.0,
        flush_s: float = 0.05,
    ) -> None:
        RedisWire(url)  # a bad URL fails here, at start-up, not on the first request
        self._url = url
        self._prefix = prefix.encode()
        self._timeout_s = timeout_s
        self._retry_s = retry_s
        self._flush_s = flush_s
        self._local = MemoryStore()
        self._wire: RedisWire | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down = False
        self._retry_at = 0.0
        # (endpoint, tpm, period, tenant's charge) -> [tokens, quota, tenant quota deltas],
        # and the latest time
        self._pending: dict[tuple[str, int, str, TenantCharge | None], list[int]] = {}
        self._pending_now = 0.0
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[None]] = set()

    # --- connection and failure state -------------------------------------------------

    def _redis(self) -> RedisWire | None:
        """The connection of the running loop, or None while Redis is considered down."""
        if self._down and time.monotonic() < self._retry_at:
            return None
        loop = asyncio.get_running_loop()
        if self._wire is None or self._loop is not loop:
            # each call's reply is due within timeout_s (the wire fails it and every call
            # behind it otherwise, and reconnects on the next)
            t = self._timeout_s
            self._wire = RedisWire(self._url, connect_timeout_s=t, reply_timeout_s=t)
            self._loop = loop
        return self._wire

    def _failed(self, exc: BaseException) -> None:
        self._retry_at = time.monotonic() + self._retry_s
        if self._wire is not None:
            self._wire.close()  # after a timeout, replies could come out of step
        if not self._down:
            self._down = True
            logger.warning(
                "redis %s unreachable (%s): limits and idempotency keys are enforced per "
                "gateway instance until it is back",
                redacted(self._url),
                type(exc).__name__,
            )

    def _ok(self) -> None:
        if self._down:
            self._down = False
            logger.warning(
                "redis %s is reachable again: limits and idempotency keys are shared",
                redacted(self._url),
            )

    def _keys(self, endpoint_id: str, period: str) -> tuple[bytes, bytes, bytes]:
        base = self._prefix + b"rl:{" + endpoint_id.encode() + b"}:"
        return base + b"r", base + b"t", base + b"q:" + period.encode()

    def _tenant_key(self, tenant_id: str, period: str) -> bytes:
        return self._prefix + b"rlt:{" + tenant_id.encode() + b"}:q:" + period.encode()

    def _record_key(self, endpoint_id: str, key: bytes) -> bytes:
        return self._prefix + b"idem:{" + endpoint_id.encode() + b"}:" + key

    # --- limits -----------------------------------------------------------------------

    async def admit(self, c: Charge, now_ms: float) -> Admission:
        wire = self._redis()
        if wire is None:
            return _local(await self._local.admit(c, now_ms))
        args = (
            f"{now_ms!r} {c.rpm} {c.tpm} {c.quota} {c.tokens_cost} {c.quota_cost} "
            f"{c.period_end_ms!r}"
        )
        keys: tuple[bytes, ...] = self._keys(c.endpoint_id, c.period)
        t = c.tenant
        if t is not None:  # N2: the tenant's counter, in the same script
            args += f" {t.quota} {t.period_end_ms!r}"
            keys += (self._tenant_key(t.tenant_id, t.period),)
        try:
            r = await wire.evalsha(_ADMIT, keys, (args.encode(),))
        except _REDIS_ERRORS as exc:
            self._failed(exc)
            return _local(await self._local.admit(c, now_ms))
        self._ok()
        verdict, retry, r_left, r_reset, t_left, t_reset, used = map(int, r.split())
        return Admission(verdict, retry, r_left, r_reset, t_left, t_reset, used)

    def settle(
        self, c: Charge, tokens_delta: int, quota_delta: int, now_ms: float, shared: bool
    ) -> None:
        if not shared:
            self._local.settle(c, tokens_delta, quota_delta, now_ms, shared)
            return
        k = (c.endpoint_id, c.tpm, c.period if c.quota else "", c.tenant)
        self._pending_now = max(self._pending_now, now_ms)
        td = tokens_delta if c.tpm else 0
        qd = quota_delta if c.quota else 0
        tqd = quota_delta if c.tenant is not None else 0
        acc = self._pending.get(k)
        if acc is None:
            self._pending[k] = [td, qd, tqd]
        else:
            acc[0] += td
            acc[1] += qd
            acc[2] += tqd
        if self._flush_timer is None:
            self._flush_timer = asyncio.get_running_loop().call_later(
                self._flush_s, self._start_flush
            )

    def _start_flush(self) -> None:
        self._flush_timer = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self) -> None:
        """Send the summed corrections, pipelined (lost if Redis is down)."""
        batch, self._pending = self._pending, {}
        batch = {k: v for k, v in batch.items() if v[0] or v[1] or v[2]}
        if not batch:
            return
        wire = self._redis()
        if wire is None:
            return
        now = repr(self._pending_now).encode()
        calls = []
        for (ep, tpm, period, tenant), (td, qd, tqd) in batch.items():
            _, tk, qk = self._keys(ep, period)
            keys: tuple[bytes, ...] = (tk, qk)
            args: tuple[bytes, ...] = (now, str(tpm).encode(), str(td).encode(), str(qd).encode())
            if tenant is not None:  # N2: the tenant's counter, corrected by the same script
                keys += (self._tenant_key(tenant.tenant_id, tenant.period),)
                args += (str(tqd).encode(),)
            calls.append(wire.evalsha(_SETTLE, keys, args))
        try:
            await asyncio.gather(*calls)
        except _REDIS_ERRORS as exc:
            self._failed(exc)
            return
        self._ok()

    # --- idempotency ------------------------------------------------------------------

    async def claim(
        self, endpoint_id: str, key: bytes, fp: bytes, lease_ms: int, now_ms: float
    ) -> Claim:
        wire = self._redis()
        if wire is None:
            return _local_claim(await self._local.claim(endpoint_id, key, fp, lease_ms, now_ms))
        token = new_token()
        try:
            r = await wire.evalsha(
                _CLAIM, (self._record_key(endpoint_id, key),), (fp, token, b"%d" % lease_ms)
            )
        except _REDIS_ERRORS as exc:
            self._failed(exc)
            return _local_claim(await self._local.claim(endpoint_id, key, fp, lease_ms, now_ms))
        self._ok()
        kind = int(r[0])
        if kind == PROCEED:
            return Claim(PROCEED, token)
        if kind == REPLAY:
            return Claim(REPLAY, response=StoredResponse.unpack(r[1]))
        return Claim(IN_FLIGHT if kind == IN_FLIGHT else MISMATCH)

    async def complete(
        self,
        endpoint_id: str,
        key: bytes,
        fp: bytes,
        packed: bytes,
        ttl_ms: int,
        now_ms: float,
        shared: bool,
    ) -> None:
        wire = self._redis() if shared else None
        if wire is None:
            await self._local.complete(endpoint_id, key, fp, packed, ttl_ms, now_ms, shared)
            return
        record = self._record_key(endpoint_id, key)
        try:
            await wire.call(b"SET", record, b"d" + fp + packed, b"PX", b"%d" % ttl_ms)
        except _REDIS_ERRORS as exc:
            self._failed(exc)
            return
        self._ok()

    async def release(
        self, endpoint_id: str, key: bytes, fp: bytes, token: bytes, shared: bool
    ) -> None:
        wire = self._redis() if shared else None
        if wire is None:
            await self._local.release(endpoint_id, key, fp, token, shared)
            return
        try:
            await wire.evalsha(
                _RELEASE, (self._record_key(endpoint_id, key),), (b"p" + fp + token,)
            )
        except _REDIS_ERRORS as exc:
            self._failed(exc)
            return
        self._ok()

    async def aclose(self) -> None:
        """Send what is pending, then close the connection (of the running loop)."""
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        if self._flushes:
            await asyncio.gather(*self._flushes, return_exceptions=True)
        if self._wire is not None and self._loop is asyncio.get_running_loop():
            await self.flush()
        if self._wire is not None:
            self._wire.close()
        self._wire = None


def _local(a: Admission) -> Admission:
    return Admission(
        a.verdict,
        a.retry_after_ms,
        a.requests_remaining,
        a.requests_reset_ms,
        a.tokens_remaining,
        a.tokens_reset_ms,
        a.used,
        shared=False,
    )


def _local_claim(c: Claim) -> Claim:
    return Claim(c.kind, c.token, c.response, shared=False)


def open_store(redis_url: str, prefix: str = "hf:") -> MemoryStore | RedisStore:
    """The store for ``HETEROFLOW_REDIS_URL``: in memory when empty."""
    return RedisStore(redis_url, prefix=prefix) if redis_url else MemoryStore()
