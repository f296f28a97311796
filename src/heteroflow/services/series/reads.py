"""Reads of the live series (issue 33): a service's, a node's (with its cards'), and the
fleet overview — scoped like every other read (``services/identity/access.py``): a member
reads their tenant's services only (404 otherwise), the nodes their tenant may use, and
an overview of their own tenant.

Input is checked here, each refusal naming its field (400): ``metrics`` (names of the
scope's metrics, comma-separated; empty: all), ``since`` (a duration "90s", "15m", "6h",
up to 24 h, or an ISO time within the last 24 h) and ``step`` (seconds, a multiple of 10
from 10 to 3,600; finer than 60 only within the last hour, where raw points exist).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.engines.registry import engine_slots
from heteroflow.core.errors import NotFound, ValidationFailed
from heteroflow.core.events import EventKind
from heteroflow.core.placement.model import may_use
from heteroflow.core.quotas import per_card_pct
from heteroflow.core.series import (
    METRICS,
    MINUTE_KEEP_S,
    MINUTE_STEP_S,
    RAW_KEEP_S,
    RAW_STEP_S,
    Point,
    resample,
)
from heteroflow.core.states import HOLDS_RESOURCES
from heteroflow.db.tables import Event, Node, Task, TaskGroup
from heteroflow.services.agents.nodes import dedicated_to
from heteroflow.services.identity.access import group_clause, visible_group
from heteroflow.services.identity.auth import Principal
from heteroflow.services.series import store
from heteroflow.services.tenancy.usage import fresh_reports

# the events marked on a service's time axis: the autoscaler's and the operator's
# scalings, the rolling updates' steps
MARKED = (
    EventKind.AUTOSCALE.value,
    EventKind.SCALED.value,
    EventKind.ROLLOUT_STARTED.value,
    EventKind.ROLLOUT_BATCH.value,
    EventKind.ROLLOUT_RETRY.value,
    EventKind.ROLLOUT_ROLLBACK.value,
    EventKind.ROLLOUT_DONE.value,
    EventKind.ROLLOUT_FAILED.value,
)
MAX_EVENTS = 200
_DURATION = re.compile(r"^([1-9][0-9]{0,5})([smh])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}


def parse_metrics(raw: str | None, scope: str) -> tuple[str, ...]:
    known = METRICS[scope]
    if not raw:
        return known
    names = [m.strip() for m in raw.split(",") if m.strip()]
    for m in names:
        if m not in known:
            raise ValidationFailed(
                f"unknown {scope} metric {m!r}; use any of {', '.join(known)}", field="metrics"
            )
    return tuple(dict.fromkeys(names))


def parse_since(raw: str | None, now: datetime) -> datetime:
    """The range's start: a duration back from ``now`` or a time; default the last hour."""
    if not raw:
        return now - timedelta(seconds=RAW_KEEP_S)
    m = _DURATION.match(raw)
    if m:
        start = now - timedelta(seconds=int(m.group(1)) * _UNIT_S[m.group(2)])
    else:
        try:
            start = datetime.fromisoformat(raw.replace("Z", "+00:00"))
            start = start.replace(tzinfo=UTC) if start.tzinfo is None else start.astimezone(UTC)
        except (ValueError, OverflowError):
            raise ValidationFailed(
                f"since {raw!r} is neither a duration (90s, 15m, 6h) nor an ISO time",
                field="since",
            ) from None
    if start >= now:
        raise ValidationFailed("since must be in the past", field="since")
    if now - start > timedelta(seconds=MINUTE_KEEP_S):
        raise ValidationFailed("since reaches back more than 24 h (kept: 24 h)", field="since")
    return start


def parse_step(step: int | None, since: datetime, now: datetime) -> int:
    """The answer's step (seconds); default: 10 s within the last hour, else 60 s."""
    span = (now - since).total_seconds()
    if step is None:
        return RAW_STEP_S if span <= RAW_KEEP_S else MINUTE_STEP_S
    if step < RAW_STEP_S or step > 3600 or step % RAW_STEP_S:
        raise ValidationFailed(
            "step must be a multiple of 10 seconds from 10 to 3600", field="step"
        )
    if step % MINUTE_STEP_S and span > RAW_KEEP_S:
        raise ValidationFailed(
            "a step finer than 60 s (or not a multiple of it) covers the last hour at most: "
            "10 s points are kept for 1 h",
            field="step",
        )
    return step


def _series(
    s: Session, scope: str, key: str, metrics: tuple[str, ...], since: datetime,
    step: int, now: datetime,
) -> dict[str, Any]:
    stored = RAW_STEP_S if step % MINUTE_STEP_S else MINUTE_STEP_S
    points = store.read(s, scope, key, stored, since)
    if step != stored:
        points = resample(points, step, metrics)
    return _columns(scope, key, step, since, now, metrics, points)


def _columns(
    scope: str, key: str, step: int, since: datetime, now: datetime,
    metrics: tuple[str, ...], points: list[Point],
) -> dict[str, Any]:
    return {
        "scope": scope,
        "key": key,
        "step": step,
        "since": since,
        "until": now,
        "times": [p.at for p in points],
        "values": {m: [p.values.get(m) for p in points] for m in metrics},
    }


def service_series(
    s: Session, who: Principal, group_id: str, *, now: datetime, metrics: str | None,
    since: str | None, step: int | None, load_stale_s: float, slots: int,
) -> dict[str, Any]:
    """A service's series, the events on its time axis and its replicas' load now."""
    g = visible_group(s, who, group_id)
    names = parse_metrics(metrics, "service")
    start = parse_since(since, now)
    step_s = parse_step(step, start, now)
    out = _series(s, "service", g.id, names, start, step_s, now)
    out["events"] = [
        {"at": at, "kind": kind, "from": frm, "to": to, "message": msg}
        for at, kind, frm, to, msg in s.execute(
            select(Event.created_at, Event.kind, Event.from_status, Event.to_status,
                   Event.message)
            .where(Event.group_id == g.id, Event.kind.in_(MARKED), Event.created_at >= start)
            .order_by(Event.created_at.desc(), Event.id.desc())
            .limit(MAX_EVENTS)
        )
    ][::-1]
    out["replicas"] = replicas_now(s, g.id, now=now, load_stale_s=load_stale_s, slots=slots)
    return out


def replicas_now(
    s: Session, group_id: str, *, now: datetime, load_stale_s: float, slots: int
) -> list[dict[str, Any]]:
    """Each current replica's load as the gateways report it now (issue 30 item 5): in
    flight (summed over gateways) against its slots (its engine's, where its arguments say:
    ``registry.engine_slots``, the fair-share bound's own; else
    ``gateway_backend_concurrency`` when set; else null), tokens/s, the engine's queue and
    KV use, latency, the gateways' capacity estimate (ms per completion token) and the
    prefix-cache hit rate since the engine started (null: the engine reports none)."""
    tasks = s.execute(
        select(Task.id, Task.name, Task.status, Task.node_id, Task.engine, Task.command,
               Task.engine_args).where(
            Task.group_id == group_id, Task.replaced_by == "",
            Task.status.in_([t.value for t in HOLDS_RESOURCES]),
        ).order_by(Task.rank, Task.id)
    ).all()
    seen: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for _, _, backends, _ in fresh_reports(s, now, load_stale_s):
        for b in backends:
            if isinstance(b, dict) and b.get("group_id") == group_id:
                seen[str(b.get("task_id"))].append(b)
    out = []
    for task_id, name, status, node_id, engine, command, engine_args in tasks:
        reports = seen.get(task_id, [])
        prefix = [b["prefix"] for b in reports if isinstance(b.get("prefix"), list)]
        hits = max((float(p[0]) for p in prefix), default=0.0)
        queries = max((float(p[1]) for p in prefix), default=0.0)
        lat = [b["latency_ms"] for b in reports if isinstance(b.get("latency_ms"), list)]
        waits = [float(b["waiting"]) for b in reports if isinstance(b.get("waiting"), int | float)]
        kvs = [float(b["kv_use"]) for b in reports if isinstance(b.get("kv_use"), int | float)]
        mpt = [float(b["ms_per_token"]) for b in reports
               if isinstance(b.get("ms_per_token"), int | float)]
        out.append({
            "task_id": task_id,
            "name": name,
            "status": status,
            "node_id": node_id,
            "gateways": len(reports),
            "in_flight": sum(int(b.get("in_flight") or 0) for b in reports),
            "slots": engine_slots(engine, command or engine_args) or slots or None,
            "tokens_per_s": round(sum(float(b.get("tokens_per_s") or 0) for b in reports), 3),
            "queue": max(waits) if waits else None,
            "kv_use": max(kvs) if kvs else None,
            "latency_p95_ms": max((float(p[1]) for p in lat), default=None),
            # the gateways' capacity estimate (their mean): ms per completion token
            "ms_per_token": round(sum(mpt) / len(mpt), 3) if mpt else None,
            "prefix_hit_rate": round(hits / queries, 4) if queries > 0 else None,
        })
    return out


def node_series(
    s: Session, who: Principal, node_id: str, *, now: datetime, metrics: str | None,
    since: str | None, step: int | None,
) -> dict[str, Any]:
    """A node's series (``metrics``: node and card metric names) and each card's."""
    node = s.get(Node, node_id)
    if node is None or not (
        who.is_operator or may_use(dedicated_to(node.labels), who.tenant_id)
    ):
        raise NotFound(f"node {node_id!r} not found")
    if metrics:
        names = [m.strip() for m in metrics.split(",") if m.strip()]
        node_m = tuple(m for m in names if m in METRICS["node"])
        card_m = tuple(m for m in names if m in METRICS["card"])
        bad = [m for m in names if m not in node_m and m not in card_m]
        if bad:
            raise ValidationFailed(
                f"unknown node or card metric {bad[0]!r}; use any of "
                f"{', '.join(METRICS['node'] + METRICS['card'])}",
                field="metrics",
            )
    else:
        node_m, card_m = METRICS["node"], METRICS["card"]
    start = parse_since(since, now)
    step_s = parse_step(step, start, now)
    cards = [
        _series(s, "card", key, card_m, start, step_s, now)
        for key in store.keys(s, "card", node.id + "/")
    ] if card_m else []
    return {"node": _series(s, "node", node.id, node_m, start, step_s, now), "cards": cards}


def fleet_overview(s: Session, who: Principal, *, limit: int = 20) -> dict[str, Any]:
    """Cards in use by tenant (by commitment), services by state, the last faults —
    a member's of their own tenant only."""
    cards: dict[str, float] = defaultdict(float)
    q = select(
        Task.tenant_id, Task.gpu_required, Task.task_type, Task.gpu_memory_utilization
    ).where(Task.status.in_([t.value for t in HOLDS_RESOURCES]), Task.gpu_required > 0)
    if not who.is_operator:
        q = q.where(Task.tenant_id == who.tenant_id)
    for tenant, required, task_type, util in s.execute(q):
        cards[tenant] += required * per_card_pct(required, task_type, util) / 100
    states = Counter(
        s.scalars(
            select(TaskGroup.status).where(TaskGroup.deleted_at.is_(None), group_clause(who))
        )
    )
    faults = select(Event.created_at, Event.kind, Event.group_id, Event.message).where(
        Event.kind.startswith("fault.")
    )
    if not who.is_operator:
        faults = faults.join(TaskGroup, TaskGroup.id == Event.group_id).where(group_clause(who))
    last = s.execute(faults.order_by(Event.created_at.desc(), Event.id.desc()).limit(limit))
    return {
        "cards_by_tenant": [
            {"tenant_id": t, "cards": round(n, 3)} for t, n in sorted(cards.items())
        ],
        "services_by_state": dict(sorted(states.items())),
        "last_faults": [
            {"at": at, "kind": kind, "service_id": gid, "message": msg}
            for at, kind, gid, msg in last
        ],
    }
