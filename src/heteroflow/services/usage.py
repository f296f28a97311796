"""Token usage (M7, N4): gateway batches into ``usage_records``, and the sums read back.

A batch row names the endpoint (the API key), its tenant and the routed model. The
member is the one who created the endpoint's key, looked up here; a key deleted between
the request and the flush (at most a flush interval, 5 s) keeps its tenant and gets an
empty member. Reports sum the rows of a time range by any of tenant / member / endpoint
/ model; members see their own tenant only, operators any.

**The gateways' load (issue 14).** Each gateway sends, with its activity, its view of
every backend (``schemas.usage.GatewayLoad``: in flight, tokens/s, engine queue and KV
use, draining). Only its latest report matters, so each gateway has one row, replaced at
every flush and stamped with the server's time of receipt (no gateway clock is trusted):
a ``platform_settings`` row named ``gateway-load:<gateway id>`` holding the report as
JSON — the table every instance already shares for cluster-wide values, so the leader
reads what any instance received and no schema change was needed. ``read_load`` reads
the reports younger than ``gateway_load_stale_s`` into a ``core.autoscale.LoadView``
(what the autoscaler scales by, what the drains of a scale-in and a rolling update wait
for); ``prune_load`` deletes the rows of gateways gone for a long while.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, delete, func, insert, select, update
from sqlalchemy.orm import Session

from heteroflow.core.autoscale import LoadView, Sample
from heteroflow.core.clock import Clock, SystemClock
from heteroflow.core.errors import NotFound, ValidationFailed
from heteroflow.db.engine import Database
from heteroflow.db.tables import InferenceEndpoint, PlatformSetting, UsageRecord
from heteroflow.schemas.usage import (
    GatewayLoad,
    UsageReport,
    UsageRow,
    UsageRowRead,
    UsageSums,
)
from heteroflow.services.auth import Principal
from heteroflow.services.idle import record_activity

GROUPS: dict[str, Any] = {
    "tenant": UsageRecord.tenant_id,
    "member": UsageRecord.user_id,
    "endpoint": UsageRecord.endpoint_id,
    "model": UsageRecord.model_name,
}
_FIELD = {"tenant": "tenant_id", "member": "member_id", "endpoint": "endpoint_id", "model": "model"}


def write_batch(s: Session, rows: Sequence[UsageRow]) -> int:
    """Append one ``usage_records`` row per batch row; returns how many were written."""
    if not rows:
        return 0
    owners = {
        eid: (tenant, member)
        for eid, tenant, member in s.execute(
            select(
                InferenceEndpoint.id, InferenceEndpoint.tenant_id, InferenceEndpoint.created_by
            ).where(InferenceEndpoint.id.in_({r.endpoint_id for r in rows}))
        )
    }
    values = []
    for r in rows:
        tenant, member = owners.get(r.endpoint_id, (r.tenant_id, ""))
        values.append(
            {
                "recorded_at": r.recorded_at,
                "endpoint_id": r.endpoint_id,
                "tenant_id": tenant,
                "user_id": member,
                "model_name": r.model,
                "requests": r.requests,
                "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens,
            }
        )
    s.execute(insert(UsageRecord), values)
    return len(values)


log = logging.getLogger(__name__)


class DbUsageSink:
    """The all-in-one server's ``UsageSink`` (and the gateway's ``ActivitySink``: each
    group's last request time, F4; and its ``ReportSink``: the same with the gateway's
    load, issue 14): writes in a worker thread."""

    def __init__(self, db: Database, clock: Clock | None = None) -> None:
        self._db = db
        self._clock: Clock = clock or SystemClock()

    async def write(self, rows: Sequence[UsageRow]) -> None:
        await asyncio.to_thread(self._write, rows)

    async def write_activity(self, activity: dict[str, datetime]) -> None:
        await asyncio.to_thread(self._write_activity, activity)

    def _write(self, rows: Sequence[UsageRow]) -> None:
        with self._db.session() as s:
            write_batch(s, rows)

    def _write_activity(self, activity: dict[str, datetime]) -> None:
        with self._db.session() as s:
            record_activity(s, activity)

    async def write_report(self, activity: dict[str, datetime], load: GatewayLoad) -> None:
        await asyncio.to_thread(self._write_report, activity, load)

    def _write_report(self, activity: dict[str, datetime], load: GatewayLoad) -> None:
        with self._db.session() as s:
            if activity:
                record_activity(s, activity)
            write_load(s, load, self._clock.now())


def parse_group_by(raw: str) -> list[str]:
    groups = [g.strip() for g in raw.split(",") if g.strip()]
    for g in groups:
        if g not in GROUPS:
            raise ValidationFailed(
                f"cannot group usage by {g!r}; use any of {', '.join(GROUPS)}", field="group_by"
            )
    if len(set(groups)) != len(groups):
        raise ValidationFailed("group_by names a field twice", field="group_by")
    return groups


def report(
    s: Session,
    who: Principal,
    *,
    start: datetime | None,
    end: datetime | None,
    group_by: list[str],
    tenant_id: str | None = None,
    member_id: str | None = None,
    endpoint_id: str | None = None,
    model: str | None = None,
) -> UsageReport:
    """Sums of requests and tokens recorded in [start, end), grouped as asked."""
    start, end = _utc(start), _utc(end)
    if start is not None and end is not None and start >= end:
        raise ValidationFailed("start must be before end", field="start")
    if not who.is_operator:
        if tenant_id is not None and tenant_id != who.tenant_id:
            raise NotFound(f"tenant {tenant_id!r} not found", field="tenant_id")
        tenant_id = who.tenant_id
    where: list[ColumnElement[bool]] = []
    if start is not None:
        where.append(UsageRecord.recorded_at >= start)
    if end is not None:
        where.append(UsageRecord.recorded_at < end)
    for column, value in (
        (UsageRecord.tenant_id, tenant_id),
        (UsageRecord.user_id, member_id),
        (UsageRecord.endpoint_id, endpoint_id),
        (UsageRecord.model_name, model),
    ):
        if value is not None:
            where.append(column == value)
    cols = [GROUPS[g] for g in group_by]
    q = (
        select(
            *cols,
            func.sum(UsageRecord.requests),
            func.sum(UsageRecord.prompt_tokens),
            func.sum(UsageRecord.completion_tokens),
        )
        .where(*where)
        .group_by(*cols)
        .order_by(*cols)
    )
    rows: list[UsageRowRead] = []
    for row in s.execute(q):
        keys, sums = row[: len(cols)], _sums(row[len(cols) :])
        fields = {_FIELD[g]: k for g, k in zip(group_by, keys, strict=True)}
        rows.append(UsageRowRead(**sums.model_dump(), **fields))
    total = _sums(
        (
            sum(r.requests for r in rows),
            sum(r.prompt_tokens for r in rows),
            sum(r.completion_tokens for r in rows),
        )
    )
    return UsageReport(start=start, end=end, group_by=group_by, rows=rows, total=total)


def _sums(values: Sequence[Any]) -> UsageSums:
    # SUM(bigint) is numeric on PostgreSQL (a Decimal) and NULL over no rows.
    requests, prompt, completion = (int(v or 0) for v in values)
    return UsageSums(
        requests=requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
    )


def _utc(t: datetime | None) -> datetime | None:
    if t is None:
        return None
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t.astimezone(UTC)


# ---- the gateways' load (issue 14) --------------------------------------------------

LOAD_KEY_PREFIX = "gateway-load:"
# a gateway silent this many staleness windows is gone: its row is deleted
_PRUNE_AFTER_WINDOWS = 10


def write_load(s: Session, load: GatewayLoad, now: datetime) -> None:
    """Replace ``load``'s gateway's report with this one, received ``now``."""
    key = LOAD_KEY_PREFIX + load.gateway_id
    value = json.dumps(
        {"at": now.isoformat(), "backends": [b.to_wire() for b in load.backends]},
        separators=(",", ":"),
    )
    res = s.execute(
        update(PlatformSetting)
        .where(PlatformSetting.key == key)
        .values(value=value)
        .execution_options(synchronize_session=False)
    )
    if not res.rowcount:  # type: ignore[attr-defined]
        # only this gateway writes its key, one flush at a time: no concurrent insert
        s.execute(insert(PlatformSetting).values(key=key, value=value))


def _parse(value: str) -> tuple[datetime, list[dict[str, Any]]] | None:
    try:
        data = json.loads(value)
        at = datetime.fromisoformat(data["at"])
        backends = data["backends"]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(backends, list):
        return None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)), backends


def _sample(b: Mapping[str, Any]) -> Sample:
    def number(key: str) -> float | None:
        v = b.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    return Sample(
        in_flight=int(b.get("in_flight") or 0),
        tokens_per_s=number("tokens_per_s") or 0.0,
        waiting=number("waiting"),
        kv_use=number("kv_use"),
        draining=b.get("draining") is True,
    )


def read_load(s: Session, now: datetime, stale_s: float) -> LoadView:
    """The reports received within ``stale_s`` of ``now``, as one view."""
    cutoff = now - timedelta(seconds=stale_s)
    gateways, oldest = 0, None
    samples: dict[str, list[Sample]] = defaultdict(list)
    rows = s.scalars(
        select(PlatformSetting).where(PlatformSetting.key.startswith(LOAD_KEY_PREFIX))
    )
    for row in rows:
        parsed = _parse(row.value)
        if parsed is None:
            log.warning("gateway load %s: unreadable; ignored", row.key)
            continue
        at, backends = parsed
        if at < cutoff:
            continue
        gateways += 1
        oldest = at if oldest is None else min(oldest, at)
        for b in backends:
            if isinstance(b, dict) and isinstance(b.get("task_id"), str):
                samples[b["task_id"]].append(_sample(b))
    return LoadView(
        gateways=gateways,
        as_of=oldest,
        samples={task_id: tuple(v) for task_id, v in samples.items()},
    )


def prune_load(s: Session, now: datetime, stale_s: float) -> int:
    """Delete the reports of gateways silent for ``_PRUNE_AFTER_WINDOWS`` windows."""
    cutoff = now - timedelta(seconds=stale_s * _PRUNE_AFTER_WINDOWS)
    gone = []
    for row in s.scalars(
        select(PlatformSetting).where(PlatformSetting.key.startswith(LOAD_KEY_PREFIX))
    ):
        parsed = _parse(row.value)
        if parsed is None or parsed[0] < cutoff:
            gone.append(row.key)
    if gone:
        s.execute(delete(PlatformSetting).where(PlatformSetting.key.in_(gone)))
    return len(gone)

