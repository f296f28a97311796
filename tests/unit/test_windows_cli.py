"""`heteroflow services window` (K1): the requests it sends and what it prints, against a
scripted API."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from heteroflow import cli
from tests.unit.test_cli import Recorder, server  # noqa: F401 - the fixture

pytestmark = pytest.mark.feature("K1")

PATH = "/api/v1/task-groups/tg-1/schedule-window"
STORED = {
    "enabled": True, "timezone": "Europe/Berlin", "days": ["mon", "tue", "wed", "thu", "fri"],
    "start": "08:00", "end": "20:00", "action": "scale", "replicas": 1,
}


def read(window: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {
        "group_id": "tg-1", "schedule_window": window, "window_action": "",
        "window_saved_replicas": None, "inside": False,
        "changes_at": "2026-01-05T07:00:00Z", "summary": "runs mon-fri 08:00-20:00 "
        "Europe/Berlin; outside: paused", **over,
    }


def test_setting_a_window_sends_the_flags_over_the_stored_one(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    rec = server((200, read({})), (200, read({})))
    argv = ["services", "window", "tg-1", "--start", "08:00", "--end", "20:00",
            "--timezone", "Europe/Berlin", "--days", "mon-fri", "--action", "pause"]
    assert cli.main(argv) == 0
    assert rec.requests == [
        ("GET", PATH, None),
        ("PUT", PATH, {
            "start": "08:00", "end": "20:00", "timezone": "Europe/Berlin",
            "days": ["mon", "tue", "wed", "thu", "fri"], "action": "pause", "enabled": True,
        }),
    ]
    out = capsys.readouterr().out
    assert "tg-1: runs mon-fri 08:00-20:00 Europe/Berlin" in out
    assert "now: outside the window (it opens 2026-01-05T07:00:00Z)" in out


def test_a_flag_left_out_keeps_its_value_and_replicas_go_with_scale(
    server: Callable[..., Recorder],  # noqa: F811
) -> None:
    rec = server((200, read(STORED)), (200, read(STORED)))
    assert cli.main(["services", "window", "tg-1", "--action", "stop"]) == 0
    sent = rec.requests[1][2]
    assert sent == {**{k: v for k, v in STORED.items() if k != "replicas"}, "action": "stop"}


@pytest.mark.parametrize(
    ("flag", "method", "body"),
    [
        ("--disable", "PUT", {**STORED, "enabled": False}),
        ("--enable", "PUT", STORED),
        ("--remove", "DELETE", None),
    ],
)
def test_disable_enable_and_remove(
    server: Callable[..., Recorder], flag: str, method: str, body: Any  # noqa: F811
) -> None:
    rec = server((200, read(STORED)), (200, read(STORED)))
    assert cli.main(["services", "window", "tg-1", flag]) == 0
    assert rec.requests[-1] == (method, PATH, body)


def test_without_options_it_shows_the_window(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    rec = server((200, read(STORED, inside=True, changes_at="2026-01-05T19:00:00Z")))
    assert cli.main(["services", "window", "tg-1"]) == 0
    assert rec.requests == [("GET", PATH, None)]
    assert "now: inside the window (it closes 2026-01-05T19:00:00Z)" in capsys.readouterr().out


def test_bad_days_and_mixed_modes_are_refused_before_any_request(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    rec = server((200, read(STORED)))
    with pytest.raises(SystemExit):
        cli.main(["services", "window", "tg-1", "--days", "mon-funday"])
    assert "unknown day 'funday'" in capsys.readouterr().err
    assert cli.main(["services", "window", "tg-1", "--disable", "--start", "08:00"]) == 1
    assert "--disable takes no other option" in capsys.readouterr().err
    assert rec.requests == []


def test_an_api_refusal_prints_its_field(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    err = {"code": "validation_error", "field": "schedule_window.timezone",
           "message": "schedule_window.timezone: Value error, unknown time zone 'Mars/X'"}
    server((200, read({})), (400, {"error": err}))
    assert cli.main(["services", "window", "tg-1", "--start", "08:00", "--end", "20:00",
                     "--timezone", "Mars/X"]) == 1
    assert "(field: schedule_window.timezone)" in capsys.readouterr().err
