"""Task lifecycle table, group status derivation, and the transition door's guard."""

from __future__ import annotations

import itertools
from typing import NoReturn, cast

import pytest
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.states import (
    TASK_TRANSITIONS,
    TERMINAL,
    GroupStatus,
    TaskStatus,
    can_transition,
    group_status,
)
from heteroflow.services.lifecycle.transitions import IllegalTransition, transition

# Written out independently of the module's table, by status value.
EXPECTED_LEGAL: dict[str, set[str]] = {
    "pending": {"scheduled", "stopped"},
    "scheduled": {"starting", "pending", "stopped", "failed"},
    # scheduled: its engine stopped with its own agent (started again on its placement)
    "starting": {"running", "failed", "stopping", "stopped", "completed", "pending", "scheduled"},
    "running": {"failed", "stopping", "stopped", "completed", "sleeping", "scheduled"},
    "sleeping": {"waking", "stopping", "stopped", "failed"},  # F1: asleep on its node
    "waking": {"running", "sleeping", "stopping", "stopped", "failed", "scheduled"},  # F2
    "stopping": {"stopped", "failed", "pending"},  # pending: a preempted task requeued (B4)
    "stopped": set(),
    "failed": {"stopped"},
    "completed": {"stopped"},
}

ALL_PAIRS = list(itertools.product(list(TaskStatus), repeat=2))


def test_expected_table_covers_every_status() -> None:
    assert set(EXPECTED_LEGAL) == {s.value for s in TaskStatus}
    assert set(TASK_TRANSITIONS) == set(TaskStatus)


@pytest.mark.parametrize(("src", "dst"), ALL_PAIRS, ids=[f"{a}->{b}" for a, b in ALL_PAIRS])
def test_can_transition_matches_expected_table(src: TaskStatus, dst: TaskStatus) -> None:
    assert can_transition(src, dst) is (dst.value in EXPECTED_LEGAL[src.value])


def test_no_self_transitions() -> None:
    for s in TaskStatus:
        assert not can_transition(s, s)


def _reachable(start: TaskStatus) -> set[TaskStatus]:
    seen: set[TaskStatus] = set()
    todo = [start]
    while todo:
        cur = todo.pop()
        for nxt in TaskStatus:
            if can_transition(cur, nxt) and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


@pytest.mark.parametrize("terminal", [TaskStatus.STOPPED, TaskStatus.FAILED, TaskStatus.COMPLETED])
def test_terminal_states_never_lead_back_to_running(terminal: TaskStatus) -> None:
    assert terminal in TERMINAL
    assert not can_transition(terminal, TaskStatus.RUNNING)
    reachable = _reachable(terminal)
    live = {TaskStatus.PENDING, TaskStatus.SCHEDULED, TaskStatus.STARTING, TaskStatus.RUNNING,
            TaskStatus.SLEEPING, TaskStatus.WAKING}
    assert not (reachable & live), f"{terminal} can reach {reachable & live}"
    assert reachable <= {TaskStatus.STOPPED}


def test_stopped_is_a_dead_end() -> None:
    assert _reachable(TaskStatus.STOPPED) == set()


T = TaskStatus
G = GroupStatus


@pytest.mark.parametrize(
    ("statuses", "deleting", "expected"),
    [
        ([], False, G.PENDING),
        ([], True, G.STOPPED),
        ([T.RUNNING], False, G.RUNNING),
        ([T.RUNNING, T.RUNNING, T.RUNNING], False, G.RUNNING),
        ([T.RUNNING, T.PENDING], False, G.SCHEDULING),
        ([T.SCHEDULED, T.PENDING], False, G.SCHEDULING),
        ([T.STARTING, T.RUNNING], False, G.SCHEDULING),
        ([T.RUNNING, T.FAILED], False, G.FAILED),
        ([T.PENDING, T.FAILED, T.STOPPED], False, G.FAILED),
        ([T.FAILED], False, G.FAILED),
        ([T.RUNNING, T.PENDING], True, G.STOPPING),
        ([T.RUNNING, T.STOPPED], True, G.STOPPING),
        ([T.STOPPING, T.STOPPED], True, G.STOPPING),
        ([T.STOPPED, T.STOPPED], True, G.STOPPED),
        ([T.STOPPED, T.FAILED, T.COMPLETED], True, G.STOPPED),
        ([T.STOPPING, T.RUNNING], False, G.STOPPING),
        ([T.STOPPED, T.STOPPED], False, G.STOPPED),
        ([T.COMPLETED, T.STOPPED], False, G.COMPLETED),
        ([T.COMPLETED], False, G.COMPLETED),
        ([T.PENDING], False, G.PENDING),
        ([T.PENDING, T.PENDING], False, G.PENDING),
        ([T.PENDING, T.STOPPED], False, G.PENDING),
        # A7: asleep, waking, and a split group with one replica asleep
        ([T.SLEEPING], False, G.SLEEPING),
        ([T.SLEEPING, T.SLEEPING, T.STOPPED], False, G.SLEEPING),
        ([T.WAKING, T.SLEEPING], False, G.WAKING),
        ([T.WAKING, T.RUNNING], False, G.WAKING),
        ([T.RUNNING, T.SLEEPING], False, G.RUNNING),
        ([T.SLEEPING, T.FAILED], False, G.FAILED),
        ([T.SLEEPING], True, G.STOPPING),
    ],
)
def test_group_status(statuses: list[TaskStatus], deleting: bool, expected: GroupStatus) -> None:
    assert group_status(statuses, deleting=deleting) is expected


def test_group_status_ignores_task_order() -> None:
    a = [T.RUNNING, T.PENDING, T.STARTING]
    assert group_status(a) is group_status(list(reversed(a)))


class _Untouchable:
    """Fails the test when anything on it is used."""

    def __getattr__(self, name: str) -> NoReturn:
        raise AssertionError(f"session/clock used before the legality check: .{name}")


ILLEGAL_PAIRS = [(a, b) for a, b in ALL_PAIRS if b.value not in EXPECTED_LEGAL[a.value]]


@pytest.mark.parametrize(
    ("src", "dst"),
    [
        (T.STOPPED, T.RUNNING),
        (T.PENDING, T.RUNNING),
        (T.FAILED, T.RUNNING),
        (T.COMPLETED, T.PENDING),
        (T.RUNNING, T.RUNNING),
    ],
)
def test_transition_refuses_illegal_pair_without_touching_session(
    src: TaskStatus, dst: TaskStatus
) -> None:
    poison = _Untouchable()
    with pytest.raises(IllegalTransition) as exc:
        transition(cast(Session, poison), cast(Clock, poison), "task-1", src, dst, "msg")
    assert str(src) in str(exc.value)
    assert str(dst) in str(exc.value)


def test_every_illegal_pair_is_refused_by_transition() -> None:
    poison = _Untouchable()
    assert len(ILLEGAL_PAIRS) == len(TaskStatus) ** 2 - sum(len(v) for v in EXPECTED_LEGAL.values())
    for src, dst in ILLEGAL_PAIRS:
        with pytest.raises(IllegalTransition):
            transition(cast(Session, poison), cast(Clock, poison), "t", src, dst)


def test_transition_legal_pair_does_reach_the_session() -> None:
    """The poison object really does trip: a legal pair gets past the guard and uses it."""
    poison = _Untouchable()
    with pytest.raises(AssertionError, match="before the legality check"):
        transition(cast(Session, poison), cast(Clock, poison), "t", T.PENDING, T.SCHEDULED)
