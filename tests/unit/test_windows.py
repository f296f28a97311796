"""Schedule windows (K1), pure: the evaluator (inside or outside at an instant: overnight
windows, days, time zones, daylight-saving change days) and the executor's decisions
(every action, restore, disable while in effect, idempotence, the owner's stop wins),
stepped through a week on a fake clock."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.core.windows import (
    Act,
    Action,
    GroupWindowState,
    Hold,
    Idle,
    Release,
    Restore,
    Window,
    decide,
    describe_days,
    expand_days,
    format_clock,
    is_inside,
    parse_clock,
    phase,
    spans,
)

pytestmark = pytest.mark.feature("K1")


def at(text: str) -> datetime:
    """An instant written in UTC: ``"2024-03-31 06:30"``."""
    return datetime.fromisoformat(text).replace(tzinfo=UTC)


def window(
    start: str,
    end: str,
    tz: str = "UTC",
    days: str = "",
    *,
    action: Action = "pause",
    replicas: int | None = None,
    enabled: bool = True,
) -> Window:
    chosen = frozenset(
        ("mon", "tue", "wed", "thu", "fri", "sat", "sun").index(d) for d in expand_days(days)
    )
    return Window(
        start=parse_clock(start), end=parse_clock(end, end=True), timezone=tz, days=chosen,
        action=action, replicas=replicas, enabled=enabled,
    )


# -- reading the clock -----------------------------------------------------------------


def test_a_daytime_window_opens_at_start_and_closes_at_end() -> None:
    w = window("08:00", "20:00")
    assert not is_inside(w, at("2026-01-01 07:59:59"))
    assert is_inside(w, at("2026-01-01 08:00"))  # the start is inside
    assert is_inside(w, at("2026-01-01 19:59:59"))
    assert not is_inside(w, at("2026-01-01 20:00"))  # the end is not
    assert phase(w, at("2026-01-01 12:00")).changes_at == at("2026-01-01 20:00")
    assert phase(w, at("2026-01-01 21:00")).changes_at == at("2026-01-02 08:00")


def test_an_overnight_window_runs_into_the_next_day() -> None:
    w = window("22:00", "06:00")
    assert w.overnight
    for inside in ("2026-01-01 22:00", "2026-01-01 23:59", "2026-01-02 00:00", "2026-01-02 05:59"):
        assert is_inside(w, at(inside)), inside
    for outside in ("2026-01-02 06:00", "2026-01-02 12:00", "2026-01-01 21:59"):
        assert not is_inside(w, at(outside)), outside
    # days name the night's first day: Friday night runs into Saturday, and Thursday
    # night (ending Friday morning) is not selected
    fri = window("22:00", "06:00", days="fri")  # 2026-01-02 is a Friday
    assert is_inside(fri, at("2026-01-03 05:00"))  # Saturday morning
    assert not is_inside(fri, at("2026-01-02 05:00"))  # Friday morning
    assert not is_inside(fri, at("2026-01-03 22:30"))  # Saturday night


def test_days_select_the_days_it_opens_and_the_next_opening_skips_the_others() -> None:
    w = window("08:00", "20:00", days="mon-fri")
    assert is_inside(w, at("2026-01-02 12:00"))  # Friday
    sat = phase(w, at("2026-01-03 12:00"))
    assert not sat.inside and sat.changes_at == at("2026-01-05 08:00")  # Monday
    assert expand_days("mon-fri,sun") == ["mon", "tue", "wed", "thu", "fri", "sun"]
    assert expand_days("fri-mon") == ["mon", "fri", "sat", "sun"]  # a range may wrap
    assert expand_days("every") == expand_days("") == []
    assert describe_days(frozenset({0, 1, 2, 3, 4, 6})) == "mon-fri,sun"
    assert describe_days(frozenset()) == "every day"
    with pytest.raises(ValueError, match="unknown day 'funday'"):
        expand_days("mon,funday")


def test_times_are_read_in_the_windows_time_zone() -> None:
    kolkata = window("09:00", "17:00", "Asia/Kolkata")  # +05:30
    assert not is_inside(kolkata, at("2026-01-01 03:29"))
    assert is_inside(kolkata, at("2026-01-01 03:30"))
    assert not is_inside(kolkata, at("2026-01-01 11:30"))
    new_york = window("09:00", "17:00", "America/New_York", days="mon-fri")  # -05:00 in Jan
    assert is_inside(new_york, at("2026-01-02 14:00"))  # Friday 09:00 EST
    assert not is_inside(new_york, at("2026-01-02 22:00"))  # Friday 17:00 EST
    # Saturday 01:00 UTC is still Friday evening in New York (outside: after 17:00)
    assert not is_inside(new_york, at("2026-01-03 01:00"))
    with pytest.raises(ValueError, match="unknown time zone"):
        window("09:00", "17:00", "Mars/Olympus_Mons")
    for bad in ("../../etc/passwd", "/etc/localtime", "localtime", "Europe/Berlin "):
        with pytest.raises(ValueError):
            window("09:00", "17:00", bad)


@pytest.mark.parametrize(
    ("day", "opens", "closes"),
    [
        # Berlin springs forward on 2024-03-31 (02:00 CET -> 03:00 CEST) and falls back
        # on 2024-10-27 (03:00 CEST -> 02:00 CET): 08:00-20:00 stays 08:00-20:00 on the
        # wall clock, so in UTC it moves by an hour across the change
        ("2024-03-30", "07:00", "19:00"),
        ("2024-03-31", "06:00", "18:00"),
        ("2024-10-26", "06:00", "18:00"),
        ("2024-10-27", "07:00", "19:00"),
    ],
)
def test_a_window_follows_the_wall_clock_across_daylight_saving_changes(
    day: str, opens: str, closes: str
) -> None:
    w = window("08:00", "20:00", "Europe/Berlin")
    found = [s for s in spans(w, at(f"{day} 12:00")) if s[0].date().isoformat() == day]
    assert found == [(at(f"{day} {opens}"), at(f"{day} {closes}"))]
    assert not is_inside(w, at(f"{day} {opens}") - timedelta(seconds=1))
    assert is_inside(w, at(f"{day} {opens}"))


def test_an_overnight_window_over_a_dst_change_is_an_hour_shorter_or_longer() -> None:
    night = window("22:00", "06:00", "Europe/Berlin")
    short = phase(night, at("2024-03-30 21:00"))  # Saturday 22:00 CET
    assert short.inside and short.changes_at == at("2024-03-31 04:00")  # 06:00 CEST: 7 h
    long = phase(night, at("2024-10-26 20:00"))  # Saturday 22:00 CEST
    assert long.inside and long.changes_at == at("2024-10-27 05:00")  # 06:00 CET: 9 h


def test_a_skipped_wall_time_is_the_jump_and_a_repeated_one_its_first_occurrence() -> None:
    # 02:30 does not exist in Berlin on 2024-03-31: the window opens at the jump (01:00 UTC)
    skipped = window("02:30", "05:00", "Europe/Berlin")
    assert not is_inside(skipped, at("2024-03-31 00:59:59"))
    assert is_inside(skipped, at("2024-03-31 01:00"))
    assert phase(skipped, at("2024-03-31 01:00")).changes_at == at("2024-03-31 03:00")
    # 02:30 happens twice on 2024-10-27: the first (02:30 CEST = 00:30 UTC)
    repeated = window("02:30", "05:00", "Europe/Berlin")
    assert not is_inside(repeated, at("2024-10-27 00:29"))
    assert is_inside(repeated, at("2024-10-27 00:30"))
    # a window wholly inside the skipped hour does not open that day
    gone = window("02:10", "02:50", "Europe/Berlin")
    assert all(s[0].date().isoformat() != "2024-03-31" for s in spans(gone, at("2024-03-31 12:00")))
    # New York springs forward on 2024-03-10 at 02:00 EST (07:00 UTC)
    ny = window("02:15", "03:30", "America/New_York")
    assert is_inside(ny, at("2024-03-10 07:00"))
    assert not is_inside(ny, at("2024-03-10 06:59"))


def test_midnight_ends_and_back_to_back_days_are_one_span() -> None:
    weekdays = window("00:00", "24:00", days="mon-fri")
    wed = phase(weekdays, at("2026-01-07 12:00"))
    assert wed.inside and wed.changes_at == at("2026-01-10 00:00")  # Saturday 00:00
    assert is_inside(weekdays, at("2026-01-08 00:00"))  # no gap at midnight
    assert not is_inside(weekdays, at("2026-01-10 00:00"))
    always = phase(window("00:00", "24:00"), at("2026-01-07 12:00"))
    assert always.inside and always.changes_at is None  # never closes
    assert format_clock(parse_clock("24:00", end=True)) == "24:00"
    with pytest.raises(ValueError, match="only an end"):
        parse_clock("24:00")
    for bad in ("8:00", "24:01", "12:60", "noon", "12:00:00"):
        with pytest.raises(ValueError):
            parse_clock(bad, end=True)
    with pytest.raises(ValueError, match="same time"):
        window("08:00", "08:00")
    with pytest.raises(ValueError, match="same time"):
        Window(start=0, end=0)
    assert not Window(start=0, end=1440).overnight  # 00:00-24:00: the whole day
    evening = window("20:00", "00:00")  # to midnight: the same as 20:00-24:00
    assert evening.overnight and phase(evening, at("2026-01-01 21:00")).changes_at == at(
        "2026-01-02 00:00"
    )


def test_a_window_rejects_replicas_except_for_scale() -> None:
    with pytest.raises(ValueError, match="replicas"):
        window("08:00", "20:00", action="scale")
    with pytest.raises(ValueError, match="replicas"):
        window("08:00", "20:00", action="pause", replicas=1)
    assert window("08:00", "20:00", action="scale", replicas=1).replicas == 1


def test_phase_needs_an_aware_instant() -> None:
    with pytest.raises(ValueError, match="aware"):
        phase(window("08:00", "20:00"), datetime(2026, 1, 1, 12))


# -- deciding --------------------------------------------------------------------------

RUNS = GroupWindowState(
    in_effect="", desired="running", current_replicas=3, saved_replicas=None,
    min_replicas=1, max_replicas=4,
)
NIGHT = at("2026-01-01 22:00")  # outside 08:00-20:00
DAY = at("2026-01-02 12:00")  # inside


def test_outside_each_action_is_put_in_effect_saving_the_replica_count() -> None:
    pause = decide(window("08:00", "20:00"), NIGHT, RUNS)
    assert pause == Act("pause", 3, None, at("2026-01-02 08:00"))
    stop = decide(window("08:00", "20:00", action="stop"), NIGHT, RUNS)
    assert isinstance(stop, Act) and (stop.action, stop.save) == ("stop", 3)
    scale = decide(window("08:00", "20:00", action="scale", replicas=1), NIGHT, RUNS)
    assert isinstance(scale, Act) and (scale.action, scale.save, scale.replicas) == ("scale", 3, 1)
    # never up (already at or below: held there), never under the group's floor
    held = decide(window("08:00", "20:00", action="scale", replicas=2), NIGHT,
                  replace(RUNS, current_replicas=2))
    assert isinstance(held, Act) and held.replicas == 2
    floor = decide(window("08:00", "20:00", action="scale", replicas=1), NIGHT,
                   replace(RUNS, min_replicas=2))
    assert isinstance(floor, Act) and floor.replicas == 2


def test_a_second_round_outside_changes_nothing() -> None:
    actions: tuple[Action, ...] = ("pause", "scale", "stop")
    for action in actions:
        w = window("08:00", "20:00", action=action, replicas=1 if action == "scale" else None)
        in_effect = replace(RUNS, in_effect=action, saved_replicas=3)
        assert decide(w, NIGHT, in_effect) == Hold(action, at("2026-01-02 08:00"))
        assert decide(w, DAY, RUNS) == Idle("inside the window")


def test_back_inside_pause_and_scale_are_restored_and_stop_is_not() -> None:
    paused = replace(RUNS, in_effect="pause", saved_replicas=3)
    assert decide(window("08:00", "20:00"), DAY, paused) == Restore("pause", "the window opened")
    scaled = replace(RUNS, in_effect="scale", saved_replicas=3, current_replicas=1)
    w = window("08:00", "20:00", action="scale", replicas=1)
    assert decide(w, DAY, scaled) == Restore("scale", "the window opened", 3)
    # never below what runs now (scaled out meanwhile), within the bounds as they are
    assert decide(w, DAY, replace(scaled, current_replicas=4)) == Restore(
        "scale", "the window opened", 4
    )
    assert decide(w, DAY, replace(scaled, max_replicas=2)) == Restore(
        "scale", "the window opened", 2
    )
    stopped = replace(RUNS, in_effect="stop", saved_replicas=3, desired="stopped")
    assert decide(window("08:00", "20:00", action="stop"), DAY, stopped) == Release(
        "stop", "the window opened"
    )


def test_a_window_disabled_or_removed_while_in_effect_is_restored() -> None:
    paused = replace(RUNS, in_effect="pause", saved_replicas=3)
    off = window("08:00", "20:00", enabled=False)
    assert decide(off, NIGHT, paused) == Restore("pause", "the window was disabled")
    assert decide(None, NIGHT, paused) == Restore("pause", "the window was removed")
    assert decide(None, NIGHT, paused, absent="the window was disabled") == Restore(
        "pause", "the window was disabled"
    )
    assert isinstance(decide(off, NIGHT, RUNS), Idle)  # nothing in effect: nothing to do


def test_the_owners_stop_wins() -> None:
    stopped = replace(RUNS, desired="stopped")
    # not acted on while stopped by its owner
    assert isinstance(decide(window("08:00", "20:00"), NIGHT, stopped), Idle)
    # stopped while paused or scaled down: not restored, only released
    actions: tuple[Action, ...] = ("pause", "scale")
    for action in actions:
        w = window("08:00", "20:00", action=action, replicas=1 if action == "scale" else None)
        step = decide(w, DAY, replace(stopped, in_effect=action, saved_replicas=3))
        assert step == Release(action, "the window opened", owner_stopped=True)


def test_a_changed_action_undoes_the_old_one_first_and_a_rollout_makes_it_wait() -> None:
    paused = replace(RUNS, in_effect="pause", saved_replicas=3)
    step = decide(window("08:00", "20:00", action="stop"), NIGHT, paused)
    assert step == Restore("pause", "the window's action changed to stop")
    busy = replace(paused, busy="a rolling update holds the service")
    assert decide(window("08:00", "20:00"), DAY, busy) == Idle(
        "a rolling update holds the service"
    )


def test_a_week_on_a_fake_clock_acts_once_per_closing_and_restores_once_per_opening() -> None:
    """mon-fri 08:00-20:00 in Berlin, a round every 15 minutes for a week: the executor's
    steps applied to a group as the service would apply them."""
    w = window("08:00", "20:00", "Europe/Berlin", days="mon-fri", action="scale", replicas=1)
    clock = FakeClock(at("2026-01-04 23:00"))  # Monday 00:00 in Berlin
    g = RUNS
    log: list[tuple[str, str]] = []
    for _ in range(7 * 24 * 4):
        step = decide(w, clock.now(), g)
        when = clock.now().astimezone(ZoneInfo("Europe/Berlin")).strftime("%a %H:%M")
        if isinstance(step, Act):
            assert step.replicas is not None
            g = replace(g, in_effect=step.action, saved_replicas=step.save,
                        current_replicas=step.replicas)
            log.append(("act", when))
        elif isinstance(step, Restore):
            assert step.replicas is not None
            g = replace(g, in_effect="", saved_replicas=None, current_replicas=step.replicas)
            log.append(("restore", when))
        else:
            assert isinstance(step, Hold | Idle)
        clock.advance(15 * 60)
    assert log == [
        ("act", "Mon 00:00"),
        *[
            entry
            for day in ("Mon", "Tue", "Wed", "Thu", "Fri")
            for entry in (("restore", f"{day} 08:00"), ("act", f"{day} 20:00"))
        ],
    ]
    assert g.current_replicas == 1 and g.saved_replicas == 3  # the weekend, scaled down
