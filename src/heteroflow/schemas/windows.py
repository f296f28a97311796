"""Wire schemas of schedule windows (K1): the config a service's owner sets, and its read.

``PUT /api/v1/task-groups/{id}/schedule-window`` takes a ``ScheduleWindowIn`` (so does
``schedule_window`` at create); every error names its field as
``schedule_window.<field>``. The rules of each field are in its description; the rules
that need the group (``check_for_group``) are checked by the service.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    StringConstraints,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from heteroflow.core.autoscale import scalable_problem
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.windows import (
    CLOCK_PATTERN,
    DAY_NAMES,
    Action,
    Window,
    parse_clock,
    zone,
)
from heteroflow.schemas.common import MAX_INT32, SafeStr, Strict, no_nul

FIELD = "schedule_window"  # what every error's field starts with
DayName = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]


# HH:MM, NUL-checked inside the optional (constraints on ``X | None`` wrap the str alone)
ClockText = Annotated[
    str, StringConstraints(max_length=5, pattern=CLOCK_PATTERN), AfterValidator(no_nul)
]


class ScheduleWindowIn(Strict):
    """When a service serves; outside, its ``action`` holds (K1)."""

    enabled: bool = Field(
        default=True,
        description="false keeps the window but stops acting on it; an action in effect "
        "is undone at the executor's next round (start, end may then be left out)",
    )
    timezone: SafeStr = Field(
        default="UTC",
        max_length=64,
        description="IANA time zone the times are read in (Europe/Berlin, "
        "America/New_York, UTC); daylight-saving changes are followed",
    )
    days: list[DayName] = Field(
        default_factory=list,
        max_length=7,
        description="the days a window opens (an overnight window belongs to the day it "
        "starts); empty = every day",
    )
    start: ClockText | None = Field(
        default=None,
        validate_default=True,
        description="local time it opens, HH:MM (required while enabled)",
    )
    end: ClockText | None = Field(
        default=None,
        validate_default=True,
        description="local time it closes, HH:MM; 24:00 = midnight; at or before start = "
        "the next day (overnight); not equal to start",
    )
    action: Action = Field(
        default="pause",
        description="outside the window: pause (the service sleeps: engines stop, memory "
        "is freed, it keeps its place and wakes on a request; inference only), scale "
        "(down to replicas), stop (stopped like its owner would; not restarted when the "
        "window opens). Pause and scale are undone when it opens",
    )
    replicas: int | None = Field(
        default=None,
        ge=1,
        le=MAX_INT32,
        validate_default=True,
        description="scale only (required there): the replica count outside the window, "
        "within [min_replicas, max_replicas] and below the current count",
    )

    @field_validator("timezone")
    @classmethod
    def _known_zone(cls, v: str) -> str:
        zone(v)  # ValueError names it
        return v

    @field_validator("days")
    @classmethod
    def _week_order(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("a day is listed twice")
        return sorted(v, key=DAY_NAMES.index)

    @field_validator("start", "end")
    @classmethod
    def _clock(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None:
            if info.data.get("enabled", True):
                raise ValueError("required while the window is enabled (HH:MM)")
            return v
        minutes = parse_clock(v, end=info.field_name == "end")
        start = info.data.get("start")
        if (
            info.field_name == "end"
            and isinstance(start, str)
            and minutes == parse_clock(start)
        ):
            raise ValueError(
                "end equals start: a window needs a length (a whole day is 00:00-24:00; "
                "for a service that always runs, remove the window)"
            )
        return v

    @field_validator("replicas")
    @classmethod
    def _scale_only(cls, v: int | None, info: ValidationInfo) -> int | None:
        action = info.data.get("action")
        if action == "scale" and v is None:
            raise ValueError("required for the scale action: the replica count outside")
        if action is not None and action != "scale" and v is not None:
            raise ValueError(f"only the scale action takes replicas (this one is {action})")
        return v

    def to_window(self) -> Window | None:
        """The core's window; None when it has no times (a disabled, empty window)."""
        if self.start is None or self.end is None:
            return None
        return Window(
            start=parse_clock(self.start),
            end=parse_clock(self.end, end=True),
            timezone=self.timezone,
            days=frozenset(DAY_NAMES.index(d) for d in self.days),
            action=self.action,
            replicas=self.replicas,
            enabled=self.enabled,
        )

    def stored(self) -> dict[str, Any]:
        """What the ``schedule_window`` column holds (and every read returns)."""
        return self.model_dump(exclude_none=True)


def parse_window(body: object) -> ScheduleWindowIn:
    """A PUT body as a window; 400 naming ``schedule_window.<field>`` otherwise."""
    if not isinstance(body, dict):
        raise ValidationFailed(f"{FIELD}: a JSON object is expected", field=FIELD)
    try:
        return ScheduleWindowIn.model_validate(body)
    except ValidationError as exc:
        errors = sorted(exc.errors(), key=lambda e: e.get("type") != "extra_forbidden")
        err = errors[0]
        where = ".".join([FIELD, *(str(p) for p in err.get("loc", ()))])
        if err.get("type") == "extra_forbidden":
            raise ValidationFailed(f"unknown field '{where}'", field=where) from None
        raise ValidationFailed(f"{where}: {err.get('msg', 'invalid value')}", field=where) from None


def stored_window(raw: object) -> ScheduleWindowIn | None:
    """The column's window, or None when there is none ({}). ``ValueError`` when what
    is stored no longer reads (a time zone gone from the zone database)."""
    if not raw:
        return None
    try:
        return ScheduleWindowIn.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(f"the stored schedule window does not read: {exc}") from None


def check_for_group(
    w: ScheduleWindowIn,
    *,
    task_type: str,
    parallelism: str = "single",
    min_replicas: int,
    max_replicas: int,
    current_replicas: int,
    window_action: str = "",
    saved_replicas: int | None = None,
) -> None:
    """The rules that need the group (400 naming the field). A disabled window is
    checked when it is enabled again. ``current_replicas`` is compared with the count
    a scale in effect saved (what runs once the window opens)."""
    if not w.enabled:
        return
    if w.action == "pause" and task_type != "inference":
        raise ValidationFailed(
            f"pause puts an inference service to sleep; this is a {task_type} group: use "
            "stop (or scale)",
            field=f"{FIELD}.action",
        )
    if w.action != "scale" or w.replicas is None:
        return
    problem = scalable_problem(task_type, parallelism)
    if problem:
        raise ValidationFailed(f"scale: {problem}; use stop", field=f"{FIELD}.action")
    running = saved_replicas if window_action == "scale" and saved_replicas else current_replicas
    if not min_replicas <= w.replicas <= max_replicas:
        raise ValidationFailed(
            f"replicas {w.replicas} is outside the group's bounds [{min_replicas}, "
            f"{max_replicas}]: lower min_replicas first to scale down that far",
            field=f"{FIELD}.replicas",
        )
    if w.replicas >= running:
        raise ValidationFailed(
            f"replicas {w.replicas} is not below the {running} replica(s) the service "
            "runs: a window only scales down (or use pause / stop)",
            field=f"{FIELD}.replicas",
        )


class ScheduleWindowRead(BaseModel):
    group_id: str
    schedule_window: dict[str, Any] = Field(description="the window as stored ({} = none)")
    window_action: str = Field(description="what the window has in effect now: '' (none), "
                               "pause, scale or stop")
    window_saved_replicas: int | None = Field(
        description="the replica count saved when the action took effect"
    )
    inside: bool | None = Field(description="inside the window now; null: no enabled window")
    changes_at: datetime | None = Field(
        description="when it next closes (inside) or opens (outside); null: not within a week"
    )
    summary: str = Field(description="the window and what happens outside it, in words")
