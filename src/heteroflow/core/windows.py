"""Schedule windows (K1): when a service serves, and what its window asks for now.

A window is a span of local time of day (``start``-``end``, minutes after midnight) in an
IANA time zone, on some days of the week (none = every day). Inside it the service runs
as its owner left it; outside it the window's action holds: ``pause`` (the service
sleeps, F1), ``scale`` (down to ``replicas``) or ``stop``.

**Reading the clock** (``phase``). Each selected day has one occurrence that starts on
that day at ``start``; an ``end`` at or before ``start`` is on the next day (overnight:
``days`` names the day a night begins), ``end`` may be 24:00 (midnight after). Local
times become instants with the zone's rules of that date, so a window stays 08:00-20:00
on the wall clock across daylight-saving changes (that day's occurrence is 11 or 13 hours
long when it spans the change). A wall time the clocks skip (02:30 on a spring-forward
night in Berlin) is the moment of the jump (03:00 CEST); a wall time they repeat (02:30
on a fall-back night) is its first occurrence. Back-to-back occurrences (00:00-24:00 on
several days) are one span.

**Deciding** (``decide``). Pure: the window, the instant, and what the group holds now
(``GroupWindowState``: the action in effect, its owner's ``desired``, the replica counts)
give one ``Step``: nothing (``Idle``), put the action in effect (``Act``, saving the
replica count first), keep it (``Hold``), undo it (``Restore``: wake, or scale back to
the saved count), or end it without undoing (``Release``: a ``stop``, or a service its
owner stopped meanwhile). ``services/lifecycle/windows.py`` applies it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from functools import lru_cache
from typing import Literal, get_args
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

Action = Literal["pause", "scale", "stop"]
ACTIONS: tuple[Action, ...] = get_args(Action)
DAY_NAMES = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")  # index = date.weekday()
MINUTES_PER_DAY = 24 * 60
RUNNING = "running"  # task_groups.desired: the owner wants it up

# Occurrences are built for this many days either side of now: every occurrence lasts
# under two days, and a change (an opening or a closing) is at most a week away.
_HORIZON_DAYS = 8
_NO_CHANGE_AFTER = timedelta(days=7)

CLOCK_PATTERN = r"^(([01][0-9]|2[0-3]):[0-5][0-9]|24:00)$"
_CLOCK = re.compile(CLOCK_PATTERN)
# An IANA key such as Europe/Berlin, America/Argentina/Buenos_Aires, UTC, Etc/GMT+5.
ZONE_PATTERN = r"^[A-Za-z][A-Za-z0-9_+-]*(/[A-Za-z0-9_+-]+){0,2}$"
_ZONE = re.compile(ZONE_PATTERN)
# Files of the zone database that are not zones a person means (host-dependent or rules)
_NOT_ZONES = frozenset({"localtime", "posixrules", "Factory"})


# -- parsing (shared by the API schema and the CLI) ------------------------------------


def parse_clock(text: str, *, end: bool = False) -> int:
    """``"08:30"`` -> 510 (minutes after midnight). ``"24:00"`` (1440) only as an end."""
    if not _CLOCK.match(text):
        raise ValueError(f"{text!r} is not a time of day as HH:MM (00:00-23:59)")
    hours, minutes = text.split(":")
    value = int(hours) * 60 + int(minutes)
    if value == MINUTES_PER_DAY and not end:
        raise ValueError("24:00 is only an end (midnight at the end of the day)")
    return value


def format_clock(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}"


def expand_days(text: str) -> list[str]:
    """``"mon-fri,sun"`` -> ``["mon", ..., "fri", "sun"]`` (week order, no repeats); a
    range may wrap (``fri-mon``); ``""``, ``"all"`` or ``"every"`` -> [] (every day)."""
    text = text.strip().lower()
    if text in ("", "all", "every", "daily"):
        return []
    chosen: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        first, _, last = part.partition("-")
        a, b = _day_index(first), _day_index(last or first)
        chosen.update((a + i) % 7 for i in range((b - a) % 7 + 1))
    return [DAY_NAMES[i] for i in sorted(chosen)]


def _day_index(name: str) -> int:
    key = name.strip().lower()[:3]
    if key not in DAY_NAMES or not name.strip().lower().startswith(key):
        raise ValueError(f"unknown day {name!r}: one of {', '.join(DAY_NAMES)}")
    return DAY_NAMES.index(key)


def describe_days(days: frozenset[int]) -> str:
    """``"mon-fri"``, ``"mon,wed,fri"``, ``"every day"``."""
    if not days or len(days) == 7:
        return "every day"
    ordered = sorted(days)
    runs: list[list[int]] = []
    for d in ordered:
        if runs and runs[-1][-1] == d - 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ",".join(
        DAY_NAMES[r[0]] if len(r) == 1 else f"{DAY_NAMES[r[0]]}-{DAY_NAMES[r[-1]]}" for r in runs
    )


@lru_cache(maxsize=256)
def zone(key: str) -> ZoneInfo:
    """The IANA zone ``key`` (``ValueError`` naming it when there is no such zone)."""
    if len(key) > 64 or not _ZONE.match(key) or key in _NOT_ZONES:
        raise ValueError(f"{key!r} is not an IANA time zone name (such as Europe/Berlin)")
    try:
        return ZoneInfo(key)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ValueError(
            f"unknown time zone {key!r}: an IANA name such as Europe/Berlin, "
            "America/New_York or UTC"
        ) from None


# -- the window ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Window:
    """A validated window (``schemas/windows.py`` builds it from the wire)."""

    start: int  # minutes after local midnight, 0-1439
    end: int  # 0-1440 (1440: 24:00); at or before start: the next day
    timezone: str = "UTC"
    days: frozenset[int] = frozenset()  # date.weekday() of the day an occurrence starts
    action: Action = "pause"
    replicas: int | None = None  # scale: the count outside the window
    enabled: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.start < MINUTES_PER_DAY:
            raise ValueError(f"start {self.start} is not a minute of the day")
        if not 0 <= self.end <= MINUTES_PER_DAY:
            raise ValueError(f"end {self.end} is not a minute of the day (0-1440)")
        if self.start == self.end:
            raise ValueError(
                "start and end are the same time: a window needs a length (a whole day "
                "is 00:00-24:00)"
            )
        if any(not 0 <= d < 7 for d in self.days):
            raise ValueError(f"days {sorted(self.days)} are not weekdays 0-6")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")
        if (self.action == "scale") != (self.replicas is not None):
            raise ValueError("replicas is given for the scale action, and only for it")
        zone(self.timezone)

    @property
    def overnight(self) -> bool:
        return self.end <= self.start

    def describe(self) -> str:
        """``"mon-fri 08:00-20:00 Europe/Berlin"``."""
        return (
            f"{describe_days(self.days)} {format_clock(self.start)}-"
            f"{format_clock(self.end)} {self.timezone}"
        )


@dataclass(frozen=True, slots=True)
class Phase:
    """Inside or outside the window at an instant, and when that changes next (the
    closing when inside, the opening when outside); None: not within a week (open all
    the time)."""

    inside: bool
    changes_at: datetime | None


def _instant(day: date, minutes: int, tz: ZoneInfo) -> datetime:
    """``minutes`` after local midnight of ``day`` (may pass 24:00) as a UTC instant."""
    local = datetime(day.year, day.month, day.day) + timedelta(minutes=minutes)
    utc = local.replace(tzinfo=tz).astimezone(UTC)  # fold 0: a repeated time's first
    if utc.astimezone(tz).replace(tzinfo=None) == local:
        return utc
    return _jump(local, tz)  # skipped by the clocks


def _jump(local: datetime, tz: ZoneInfo) -> datetime:
    """The instant the clocks jumped over ``local`` (a wall time in a gap): read with
    the offsets before and after the jump it gives two instants, one either side of it;
    the jump is the first second carrying the later offset."""
    a = local.replace(tzinfo=tz, fold=0).astimezone(UTC)
    b = local.replace(tzinfo=tz, fold=1).astimezone(UTC)
    lo, hi = int(min(a, b).timestamp()), int(max(a, b).timestamp())
    after = datetime.fromtimestamp(hi, UTC).astimezone(tz).utcoffset()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, UTC).astimezone(tz).utcoffset() == after:
            hi = mid
        else:
            lo = mid
    return datetime.fromtimestamp(hi, UTC)


def spans(w: Window, now: datetime) -> list[tuple[datetime, datetime]]:
    """The window's spans (UTC, start inclusive, end exclusive) from about a week
    before ``now`` to a week after, back-to-back occurrences merged."""
    tz = zone(w.timezone)
    today = now.astimezone(tz).date()
    end_minutes = w.end + MINUTES_PER_DAY if w.overnight else w.end
    occurrences: list[tuple[datetime, datetime]] = []
    for k in range(-_HORIZON_DAYS, _HORIZON_DAYS + 1):
        day = today + timedelta(days=k)
        if w.days and day.weekday() not in w.days:
            continue
        start, end = _instant(day, w.start, tz), _instant(day, end_minutes, tz)
        if end > start:  # a window wholly inside a skipped hour does not open that day
            occurrences.append((start, end))
    merged: list[tuple[datetime, datetime]] = []
    for start, end in sorted(occurrences):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def phase(w: Window, now: datetime) -> Phase:
    """Inside or outside ``w`` at ``now`` (an aware instant), and the next change."""
    if now.tzinfo is None:
        raise ValueError("now must be an aware datetime")
    for start, end in spans(w, now):
        if start <= now < end:
            return Phase(True, end if end - now <= _NO_CHANGE_AFTER else None)
        if start > now:
            return Phase(False, start)
    return Phase(False, None)  # pragma: no cover - a week always holds a selected day


def is_inside(w: Window, now: datetime) -> bool:
    return phase(w, now).inside


# -- deciding --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GroupWindowState:
    """What the executor reads of a group."""

    in_effect: str  # "" or the action the executor put in effect
    desired: str  # "running" | "stopped" (the owner's word)
    current_replicas: int
    saved_replicas: int | None
    min_replicas: int
    max_replicas: int
    busy: str = ""  # why the window must wait (a rolling update holds the group)


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to do."""

    reason: str


@dataclass(frozen=True, slots=True)
class Act:
    """Put ``action`` in effect: save ``save`` replicas first; ``replicas`` is the count
    to scale to (scale only; equal to the current count: nothing to remove)."""

    action: Action
    save: int
    replicas: int | None = None
    reopens_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Hold:
    """The action is in effect and the window still closed: keep it (a pause also puts
    back to sleep a replica that came up by a start meanwhile, services/lifecycle/windows.py)."""

    action: Action
    reopens_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class Restore:
    """Undo the action: wake (pause) or scale back to ``replicas`` (scale)."""

    action: Action
    why: str
    replicas: int | None = None


@dataclass(frozen=True, slots=True)
class Release:
    """End the action without undoing it: ``stop`` is never undone (its owner starts
    it), and a service its owner stopped meanwhile stays stopped."""

    action: str
    why: str
    owner_stopped: bool = False


Step = Idle | Act | Hold | Restore | Release


def decide(
    w: Window | None,
    now: datetime,
    g: GroupWindowState,
    *,
    absent: str = "the window was removed",
) -> Step:
    """What the window asks of the group at ``now`` (the module's docstring). ``w``
    None: no window in force, ``absent`` says why (removed, disabled, unreadable)."""
    if g.busy:
        return Idle(g.busy)
    if w is None or not w.enabled:
        why = absent if w is None else "the window was disabled"
        return _end(g, why) if g.in_effect else Idle(f"no window in force ({why})")
    now_phase = phase(w, now)
    if now_phase.inside:
        return _end(g, "the window opened") if g.in_effect else Idle("inside the window")
    if g.in_effect:
        if g.in_effect != w.action:
            return _end(g, f"the window's action changed to {w.action}")
        return Hold(w.action, now_phase.changes_at)
    if g.desired != RUNNING:
        return Idle("stopped by its owner: nothing to do outside the window")
    if w.action == "scale":
        assert w.replicas is not None
        # never up (a window only takes away), never under the group's floor
        target = max(g.min_replicas, min(g.current_replicas, w.replicas))
        return Act("scale", g.current_replicas, target, now_phase.changes_at)
    return Act(w.action, g.current_replicas, None, now_phase.changes_at)


def _end(g: GroupWindowState, why: str) -> Step:
    action = g.in_effect
    if action not in ACTIONS or action == "stop":
        return Release(action, why)
    if g.desired != RUNNING:
        return Release(action, why, owner_stopped=True)
    if action == "scale":
        saved = g.saved_replicas if g.saved_replicas is not None else g.current_replicas
        # back to the saved count, never below what runs now (a person may have scaled
        # out meanwhile), within the group's bounds as they are now
        target = min(g.max_replicas, max(g.min_replicas, saved, g.current_replicas))
        return Restore("scale", why, target)
    return Restore("pause", why)


def action_text(w: Window) -> str:
    """What happens outside the window, in words."""
    if w.action == "pause":
        return "paused (its engines sleep; it keeps its place and wakes on a request)"
    if w.action == "scale":
        return f"scaled down to {w.replicas} replica(s)"
    return "stopped (and left stopped: its owner starts it)"
