"""The schedule window's config (K1): what the wire accepts, what it stores, and every
refusal naming its field as ``schedule_window.<field>`` (the PUT body and create)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from heteroflow.core.errors import ValidationFailed
from heteroflow.schemas.task_groups import TaskGroupCreate
from heteroflow.schemas.windows import (
    ScheduleWindowIn,
    check_for_group,
    parse_window,
    stored_window,
)

pytestmark = pytest.mark.feature("K1")

GOOD = {"timezone": "Europe/Berlin", "days": ["fri", "mon"], "start": "08:00", "end": "20:00"}


def test_a_window_is_stored_normalised_and_reads_back() -> None:
    w = parse_window(GOOD)
    assert w.stored() == {
        "enabled": True, "timezone": "Europe/Berlin", "days": ["mon", "fri"],
        "start": "08:00", "end": "20:00", "action": "pause",
    }
    core = w.to_window()
    assert core is not None and core.describe() == "mon,fri 08:00-20:00 Europe/Berlin"
    again = stored_window(w.stored())
    assert again is not None and again.stored() == w.stored()
    assert stored_window({}) is None
    scale = parse_window({**GOOD, "action": "scale", "replicas": 1})
    assert scale.stored()["replicas"] == 1
    # disabled: the times may be left out
    off = parse_window({"enabled": False})
    assert off.to_window() is None and off.stored() == {
        "enabled": False, "timezone": "UTC", "days": [], "action": "pause",
    }


@pytest.mark.parametrize(
    ("body", "field", "says"),
    [
        ({**GOOD, "timezone": "Europe/Nowhere"}, "schedule_window.timezone", "unknown time zone"),
        ({**GOOD, "timezone": "../etc/passwd"}, "schedule_window.timezone", "IANA"),
        ({**GOOD, "timezone": 1}, "schedule_window.timezone", "string"),
        ({**GOOD, "days": ["mon", "funday"]}, "schedule_window.days.1", "'mon'"),
        ({**GOOD, "days": ["mon", "mon"]}, "schedule_window.days", "twice"),
        ({**GOOD, "days": "mon-fri"}, "schedule_window.days", "list"),
        ({**GOOD, "start": "8:00"}, "schedule_window.start", "pattern"),
        ({**GOOD, "start": "24:00"}, "schedule_window.start", "only an end"),
        ({**GOOD, "end": "20:61"}, "schedule_window.end", "pattern"),
        ({**GOOD, "end": "08:00"}, "schedule_window.end", "end equals start"),
        ({"timezone": "UTC", "end": "20:00"}, "schedule_window.start", "required"),
        ({"start": "08:00"}, "schedule_window.end", "required"),
        ({**GOOD, "action": "hibernate"}, "schedule_window.action", "'pause'"),
        ({**GOOD, "action": "scale"}, "schedule_window.replicas", "required for the scale"),
        ({**GOOD, "replicas": 2}, "schedule_window.replicas", "only the scale action"),
        ({**GOOD, "action": "scale", "replicas": 0}, "schedule_window.replicas", "greater"),
        ({**GOOD, "action": "scale", "replicas": True}, "schedule_window.replicas", "integer"),
        ({**GOOD, "enabled": "yes"}, "schedule_window.enabled", "boolean"),
        ({**GOOD, "grace": 5}, "schedule_window.grace", "unknown field"),
    ],
)
def test_every_refusal_names_its_field(body: dict[str, Any], field: str, says: str) -> None:
    with pytest.raises(ValidationFailed) as exc:
        parse_window(body)
    assert exc.value.field == field
    assert says in exc.value.message
    # the same body at create: pydantic's own location, which the API prints the same way
    with pytest.raises(ValidationError) as at_create:
        TaskGroupCreate.model_validate(
            {"name": "svc", "task": {"model_path": "m.gguf"}, "schedule_window": body}
        )
    first = at_create.value.errors()[0]
    assert ".".join(str(p) for p in first["loc"]) == field


def test_a_body_that_is_not_an_object_is_refused() -> None:
    bodies: tuple[object, ...] = (None, [], "08:00-20:00", 3)
    for body in bodies:
        with pytest.raises(ValidationFailed) as exc:
            parse_window(body)
        assert exc.value.field == "schedule_window"


def _check(w: ScheduleWindowIn, **over: Any) -> None:
    group: dict[str, Any] = {
        "task_type": "inference", "min_replicas": 1, "max_replicas": 4, "current_replicas": 3,
    }
    check_for_group(w, **{**group, **over})


def test_the_rules_that_need_the_group() -> None:
    scale = parse_window({**GOOD, "action": "scale", "replicas": 2})
    _check(scale)
    _check(parse_window(GOOD))
    with pytest.raises(ValidationFailed, match="inference service") as exc:
        _check(parse_window(GOOD), task_type="training")
    assert exc.value.field == "schedule_window.action"
    _check(parse_window({**GOOD, "action": "stop"}), task_type="training")
    with pytest.raises(ValidationFailed, match=r"outside the group's bounds \[3, 4\]") as exc:
        _check(scale, min_replicas=3)
    assert exc.value.field == "schedule_window.replicas"
    with pytest.raises(ValidationFailed, match="not below the 2 replica"):
        _check(scale, current_replicas=2)
    # while its scale is in effect the count compared is the one it saved
    _check(scale, current_replicas=2, window_action="scale", saved_replicas=3)
    # a disabled window is checked when it is enabled again
    _check(parse_window({**GOOD, "enabled": False}), task_type="training")
