"""The series in the database (``series_points``): write a sample, prune, read.

A sample writes two rows per series: its raw 10 s point, and the minute point merged
with it (``core.series.merge``: a running mean). The prune deletes what is past each
resolution's window; it runs every round, so the table never holds more than
``core.series.MAX_POINTS_PER_SERIES`` rows per series (plus one round's). Series of a
service, node or card that went away age out with their points.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from sqlalchemy import and_, delete, or_, select
from sqlalchemy.orm import Session

from heteroflow.core.series import (
    MINUTE_STEP_S,
    RAW_STEP_S,
    Point,
    bucket,
    clean,
    keep_from,
    merge,
    public,
)
from heteroflow.db.tables import SeriesPoint

Sample = Mapping[tuple[str, str], Mapping[str, float | None]]


def write(s: Session, at: datetime, sample: Sample) -> int:
    """One sample of every series in ``sample`` ((scope, key) -> values) at ``at``."""
    raw_at, minute_at = bucket(at, RAW_STEP_S), bucket(at, MINUTE_STEP_S)
    keys = list(sample)
    minutes: dict[tuple[str, str], SeriesPoint] = {}
    if keys:
        for row in s.scalars(
            select(SeriesPoint).where(
                SeriesPoint.step == MINUTE_STEP_S,
                SeriesPoint.at == minute_at,
                or_(*(and_(SeriesPoint.scope == sc, SeriesPoint.key == k) for sc, k in keys)),
            )
        ):
            minutes[(row.scope, row.key)] = row
    for (scope, key), values in sample.items():
        vals = clean(values, scope)
        raw = s.get(SeriesPoint, (scope, key, RAW_STEP_S, raw_at))
        if raw is None:
            s.add(SeriesPoint(scope=scope, key=key, step=RAW_STEP_S, at=raw_at, values=vals))
        else:  # a second sample in the same 10 s (a new leader's first round): the latest
            raw.values = vals
        minute = minutes.get((scope, key))
        if minute is None:
            s.add(
                SeriesPoint(
                    scope=scope, key=key, step=MINUTE_STEP_S, at=minute_at,
                    values=merge(None, vals),
                )
            )
        else:
            minute.values = merge(minute.values, vals)
    s.flush()
    return len(sample)


def prune(s: Session, now: datetime) -> int:
    """Delete the points past their resolution's window; how many."""
    gone = 0
    for step in (RAW_STEP_S, MINUTE_STEP_S):
        res = s.execute(
            delete(SeriesPoint)
            .where(SeriesPoint.step == step, SeriesPoint.at < keep_from(now, step))
            .execution_options(synchronize_session=False)
        )
        gone += res.rowcount  # type: ignore[attr-defined]
    return gone


def read(s: Session, scope: str, key: str, step: int, since: datetime) -> list[Point]:
    """A series' points of resolution ``step`` from ``since``, oldest first."""
    rows = s.execute(
        select(SeriesPoint.at, SeriesPoint.values)
        .where(
            SeriesPoint.scope == scope,
            SeriesPoint.key == key,
            SeriesPoint.step == step,
            SeriesPoint.at >= bucket(since, step),
        )
        .order_by(SeriesPoint.at)
    )
    return [Point(at, public(values or {})) for at, values in rows]


def keys(s: Session, scope: str, prefix: str) -> list[str]:
    """The keys of ``scope`` starting with ``prefix`` (a node's cards: "node/")."""
    return list(
        s.scalars(
            select(SeriesPoint.key)
            .where(SeriesPoint.scope == scope, SeriesPoint.key.startswith(prefix))
            .distinct()
            .order_by(SeriesPoint.key)
        )
    )
