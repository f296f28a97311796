"""Token usage (M7, N4): gateway batches into ``usage_records``, and the sums read back.

A batch row names the endpoint (the API key), its tenant and the routed model. The
member is the one who created the endpoint's key, looked up here; a key deleted between
the request and the flush (at most a flush interval, 5 s) keeps its tenant and gets an
empty member. Reports sum the rows of a time range by any of tenant / member / endpoint
/ model / service (the key's service, kept with the record: it outlives the key, which is
deleted with its service) / UTC hour / day; members see their own
tenant only (a member of a ``members_see_own`` tenant: their own keys and tasks only),
operators any.

**GPU time beside tokens (N4).** With ``gpu`` the report adds, per row and in the
total, the card-seconds (by commitment) and task-seconds held running and sleeping
(``services/tenancy/gpu_time.py``). GPU time has the dimensions tenant, member (the task's
owner), service and model (the group's ``model_name``) and hour/day, but no endpoint:
rows grouped by endpoint carry null GPU fields (the total still sums it), and a filter
by endpoint makes them null everywhere. A grouping by hour or day needs a start and a
range of at most 31 or 366 days (the work is bounded by the buckets). The answer keeps
its old shape unless asked for more: the GPU fields only with ``gpu``, ``service_id``,
``hour`` and ``day`` only when grouped by.

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
import csv
import io
import json
import logging
from collections import defaultdict
from collections.abc import Mapping, Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, delete, func, insert, select, update
from sqlalchemy.orm import Session

from heteroflow.core.autoscale import LoadView, Sample
from heteroflow.core.clock import Clock, SystemClock
from heteroflow.core.errors import NotFound, ValidationFailed
from heteroflow.core.metering import Meter, Unit, span_refusal
from heteroflow.db.engine import Database
from heteroflow.db.tables import InferenceEndpoint, PlatformSetting, UsageRecord
from heteroflow.schemas.usage import (
    GPU_FIELDS,
    GatewayLoad,
    UsageReport,
    UsageRow,
    UsageRowRead,
    UsageSums,
)
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle.idle import record_activity
from heteroflow.services.serving.endpoints import foreign_groups
from heteroflow.services.tenancy import gpu_time
from heteroflow.services.tenancy.gpu_time import Key

GROUPS: dict[str, Any] = {
    "tenant": UsageRecord.tenant_id,
    "member": UsageRecord.user_id,
    "endpoint": UsageRecord.endpoint_id,
    "model": UsageRecord.model_name,
    "service": UsageRecord.group_id,  # the key's service when written (outlives the key)
    "hour": None,  # UTC buckets of recorded_at (_bucket)
    "day": None,
}
_FIELD = {
    "tenant": "tenant_id", "member": "member_id", "endpoint": "endpoint_id", "model": "model",
    "service": "service_id", "hour": "hour", "day": "day",
}
# always in a row, null when not grouped by (the report's shape before N4's GPU time)
_LEGACY = ("tenant_id", "member_id", "endpoint_id", "model")


def write_batch(s: Session, rows: Sequence[UsageRow]) -> int:
    """Append one ``usage_records`` row per batch row; returns how many were written."""
    if not rows:
        return 0
    owners = {
        eid: (tenant, member, group)
        for eid, tenant, member, group in s.execute(
            select(
                InferenceEndpoint.id, InferenceEndpoint.tenant_id, InferenceEndpoint.created_by,
                InferenceEndpoint.group_id,
            ).where(InferenceEndpoint.id.in_({r.endpoint_id for r in rows}))
        )
    }
    values = []
    for r in rows:
        tenant, member, group = owners.get(r.endpoint_id, (r.tenant_id, "", None))
        values.append(
            {
                "recorded_at": r.recorded_at,
                "endpoint_id": r.endpoint_id,
                "tenant_id": tenant,
                "user_id": member,
                "group_id": group,
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
    now: datetime,
    start: datetime | None,
    end: datetime | None,
    group_by: list[str],
    tenant_id: str | None = None,
    member_id: str | None = None,
    endpoint_id: str | None = None,
    model: str | None = None,
    service_id: str | None = None,
    gpu: bool = False,
) -> UsageReport:
    """Sums of requests and tokens recorded in [start, end), grouped as asked; with
    ``gpu`` the GPU time held in that range too (``services/tenancy/gpu_time.sums``; segments
    still open count up to ``now``)."""
    start, end = _utc(start), _utc(end)
    if start is not None and end is not None and start >= end:
        raise ValidationFailed("start must be before end", field="start")
    unit: Unit | None = "hour" if "hour" in group_by else "day" if "day" in group_by else None
    too_wide = span_refusal(start, end or now, unit)
    if too_wide is not None:
        raise ValidationFailed(too_wide, field="start")
    if not who.is_operator:
        if tenant_id is not None and tenant_id != who.tenant_id:
            raise NotFound(f"tenant {tenant_id!r} not found", field="tenant_id")
        tenant_id = who.tenant_id
        if who.own_only:  # N5: the keys they created, the tasks they own
            if member_id is not None and member_id != who.user_id:
                raise NotFound(f"member {member_id!r} not found", field="member_id")
            member_id = who.user_id
    tokens = _token_sums(
        s, start=start, end=end, group_by=group_by, tenant_id=tenant_id,
        member_id=member_id, endpoint_id=endpoint_id, model=model, service_id=service_id,
    )
    # GPU time has no endpoint: null when filtered by one, and in rows grouped by one
    gpu_total = gpu and endpoint_id is None
    gpu_rows = gpu_total and "endpoint" not in group_by
    meters: dict[Key, Meter] = {}
    total_meter: Meter | None = None
    if gpu_total:
        found = gpu_time.sums(
            s, lo=start, hi=now if end is None else min(end, now),
            group_by=group_by if gpu_rows else [],
            tenant_id=tenant_id, member_id=member_id, service_id=service_id, model=model,
        )
        total_meter = Meter()
        for m in found.values():
            total_meter.merge(m)
        if gpu_rows:
            meters = found
    rows: list[UsageRowRead] = []
    for key in sorted(tokens.keys() | meters.keys(), key=_order):
        sums = _sums(tokens.get(key, (0, 0, 0)))
        row: dict[str, Any] = {f: None for f in _LEGACY}
        row.update({_FIELD[g]: k for g, k in zip(group_by, key, strict=True)})
        if gpu:
            row.update(_gpu_fields(meters.get(key, Meter()) if gpu_rows else None))
        rows.append(UsageRowRead(**sums.model_dump(exclude_unset=True), **row))
    if "service" in group_by:  # issue 26: a service shared with the tenant is not named
        foreign = foreign_groups(s, who, (r.service_id for r in rows))
        rows = [r.model_copy(update={"service_id": ""}) if r.service_id in foreign else r
                for r in rows]
    total = _sums(
        (
            sum(r.requests for r in rows),
            sum(r.prompt_tokens for r in rows),
            sum(r.completion_tokens for r in rows),
        )
    )
    if gpu:
        total = UsageSums(**total.model_dump(exclude_unset=True), **_gpu_fields(total_meter))
    return UsageReport(start=start, end=end, group_by=group_by, rows=rows, total=total)


def _token_sums(
    s: Session,
    *,
    start: datetime | None,
    end: datetime | None,
    group_by: list[str],
    tenant_id: str | None,
    member_id: str | None,
    endpoint_id: str | None,
    model: str | None,
    service_id: str | None,
) -> dict[Key, tuple[int, int, int]]:
    """(requests, prompt, completion) per key (the values of ``group_by``, in order)."""
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
        (UsageRecord.group_id, service_id),
    ):
        if value is not None:
            where.append(column == value)
    dialect = s.get_bind().dialect.name
    cols = [GROUPS[g] if GROUPS[g] is not None else _bucket(dialect, g) for g in group_by]
    q = select(
        *cols,
        func.sum(UsageRecord.requests),
        func.sum(UsageRecord.prompt_tokens),
        func.sum(UsageRecord.completion_tokens),
    )
    q = q.where(*where).group_by(*cols)
    out: dict[Key, tuple[int, int, int]] = {}
    for row in s.execute(q):
        keys = tuple(
            _parse_bucket(g, k) if g in ("hour", "day") else k
            for g, k in zip(group_by, row[: len(cols)], strict=True)
        )
        requests, prompt, completion = (int(v or 0) for v in row[len(cols) :])
        out[keys] = (requests, prompt, completion)
    return out


# a bucket as text, the same on both databases: "2026-03-01 05" (hour), "2026-03-01"
_PG_FORMAT = {"hour": "YYYY-MM-DD HH24", "day": "YYYY-MM-DD"}
_SQLITE_FORMAT = {"hour": "%Y-%m-%d %H", "day": "%Y-%m-%d"}


def _bucket(dialect: str, unit: str) -> ColumnElement[Any]:
    """``recorded_at``'s UTC hour or day as text (SQLite stores UTC without a zone)."""
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", UsageRecord.recorded_at), _PG_FORMAT[unit])
    return func.strftime(_SQLITE_FORMAT[unit], UsageRecord.recorded_at)


def _parse_bucket(unit: str, text: str | None) -> datetime | date | None:
    if text is None:
        return None
    if unit == "hour":
        return datetime.strptime(text, "%Y-%m-%d %H").replace(tzinfo=UTC)
    return date.fromisoformat(text)


def _order(key: Key) -> tuple[tuple[bool, Any], ...]:
    """Rows in key order, nulls last."""
    return tuple((v is None, "" if v is None else v) for v in key)


def _gpu_fields(m: Meter | None) -> dict[str, float | None]:
    if m is None:
        return dict.fromkeys(GPU_FIELDS)
    return {
        "gpu_running_card_seconds": m.running_card_seconds,
        "gpu_sleeping_card_seconds": m.sleeping_card_seconds,
        "running_task_seconds": m.running_task_seconds,
        "sleeping_task_seconds": m.sleeping_task_seconds,
    }


def _sums(values: Sequence[Any]) -> UsageSums:
    # SUM(bigint) is numeric on PostgreSQL (a Decimal) and NULL over no rows.
    requests, prompt, completion = (int(v or 0) for v in values)
    return UsageSums(
        requests=requests,
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
    )


def to_csv(rep: UsageReport, gpu: bool) -> str:
    """The report's rows as CSV: a header, then one line per row — the grouped fields in
    ``group_by``'s order, the token sums, and the GPU fields when asked (null: empty).
    A text cell that a spreadsheet would read as a formula starts with a quote."""
    names = [_FIELD[g] for g in rep.group_by]
    sums = ["requests", "prompt_tokens", "completion_tokens", "total_tokens"]
    header = names + sums + (list(GPU_FIELDS) if gpu else [])
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\r\n")
    w.writerow(header)
    for r in rep.rows:
        w.writerow([_cell(getattr(r, f)) for f in header])
    return buf.getvalue()


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, datetime):
        return v.isoformat().replace("+00:00", "Z")
    if isinstance(v, date):
        return v.isoformat()
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return str(v)


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
    report: dict[str, Any] = {
        "at": now.isoformat(), "backends": [b.to_wire() for b in load.backends]
    }
    if load.refused:  # issue 33: per service, refused before a backend was chosen
        report["refused"] = {g: dict(e) for g, e in load.refused.items()}
    value = json.dumps(report, separators=(",", ":"))
    res = s.execute(
        update(PlatformSetting)
        .where(PlatformSetting.key == key)
        .values(value=value)
        .execution_options(synchronize_session=False)
    )
    if not res.rowcount:  # type: ignore[attr-defined]
        # only this gateway writes its key, one flush at a time: no concurrent insert
        s.execute(insert(PlatformSetting).values(key=key, value=value))


def _parse(value: str) -> tuple[datetime, list[dict[str, Any]], dict[str, Any]] | None:
    try:
        data = json.loads(value)
        at = datetime.fromisoformat(data["at"])
        backends = data["backends"]
        refused = data.get("refused", {})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(backends, list) or not isinstance(refused, dict):
        return None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)), backends, refused


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


def fresh_reports(
    s: Session, now: datetime, stale_s: float
) -> list[tuple[str, datetime, list[dict[str, Any]], dict[str, Any]]]:
    """(gateway id, received at, backends, refused per service) of the reports received
    within ``stale_s`` of ``now`` (what ``read_load`` sums; the live series read them
    too, issue 33)."""
    cutoff = now - timedelta(seconds=stale_s)
    out = []
    rows = s.scalars(
        select(PlatformSetting).where(PlatformSetting.key.startswith(LOAD_KEY_PREFIX))
    )
    for row in rows:
        parsed = _parse(row.value)
        if parsed is None:
            log.warning("gateway load %s: unreadable; ignored", row.key)
            continue
        at, backends, refused = parsed
        if at >= cutoff:
            out.append((row.key.removeprefix(LOAD_KEY_PREFIX), at, backends, refused))
    return out


def read_load(s: Session, now: datetime, stale_s: float) -> LoadView:
    """The reports received within ``stale_s`` of ``now``, as one view."""
    gateways, oldest = 0, None
    samples: dict[str, list[Sample]] = defaultdict(list)
    for _, at, backends, _ in fresh_reports(s, now, stale_s):
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

