"""Types where strings travelled (issue 11): events carry their node and a typed kind,
the node watch never reads a message, and the state door takes typed fields.

The static half of "a wrong field type is a type error" is this file itself: mypy runs
strict over tests with ``warn_unused_ignores``, so each ``# type: ignore[...]`` below
fails the check the day the call it marks stops being a type error.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock, FakeClock
from heteroflow.core.events import EventKind
from heteroflow.core.ports import PortMapping
from heteroflow.core.states import FileRequestStatus, TaskStatus
from heteroflow.db.engine import Database, make_engine, migrate
from heteroflow.db.tables import Event
from heteroflow.schemas.files import FileRequestDone
from heteroflow.schemas.nodes import TaskReport
from heteroflow.services.lifecycle import faults
from heteroflow.services.lifecycle.transitions import UNSET, TaskUpdate, transition

from .conftest import Api, service_body
from .test_fault_events import create, start, watch_round


def _node_rows(api: Api) -> list[Event]:
    with api.app.db.session() as s:
        return list(
            s.scalars(
                select(Event)
                .where(Event.kind.in_([EventKind.NODE_LOST, EventKind.NODE_BACK]))
                .order_by(Event.id)
            )
        )


@pytest.mark.feature("E2")
def test_node_watch_reads_node_id_and_kind_not_the_message(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fault message is reworded as it is written, and the stored ones are
    overwritten between rounds: loss and return are still each recorded exactly once."""
    real = faults.record

    def reworded(*args: Any, **kw: Any) -> None:
        kw["message"] = "something happened somewhere"
        real(*args, **kw)

    monkeypatch.setattr(faults, "record", reworded)

    def scramble_messages() -> None:
        with api.app.db.session() as s:
            s.execute(update(Event).values(message="node elsewhere lost: nothing to parse"))

    admin = api.login()
    node_id = api.heartbeat()
    api.heartbeat("node-idle")
    group_id, task_id = create(api, admin, service_body())
    assert api.app.scheduler.run_round().placed == 1
    start(api, node_id, task_id)

    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    assert watch_round(api).lost == ["node-a"]
    scramble_messages()
    assert watch_round(api).lost == []  # recorded by node_id + kind: written once
    rows = _node_rows(api)
    assert [(e.kind, e.group_id, e.node_id) for e in rows] == [
        (EventKind.NODE_LOST, None, node_id),  # the node-level mark
        (EventKind.NODE_LOST, group_id, node_id),
    ]
    assert rows[1].task_id == task_id

    api.heartbeat()
    assert watch_round(api).back == ["node-a"]
    scramble_messages()
    assert watch_round(api).back == []
    kinds = [(e.kind, e.group_id) for e in _node_rows(api)]
    assert kinds[2:] == [(EventKind.NODE_BACK, None), (EventKind.NODE_BACK, group_id)]

    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    assert watch_round(api).lost == ["node-a"]  # a second loss is a new fact
    assert watch_round(api).lost == []


@pytest.mark.feature("E2")
def test_node_back_tells_only_the_groups_lost_on_that_node(api: Api) -> None:
    """Two nodes lost together: each return is matched by node_id, not by a name prefix
    (``node-a`` is a prefix of ``node-ab``)."""
    admin = api.login()
    a = api.heartbeat("node-a")
    ab = api.heartbeat("node-ab")
    placed: dict[str, str] = {}
    for name in ("one", "two"):
        group_id, task_id = create(api, admin, service_body(name=name))
        assert api.app.scheduler.run_round().placed == 1
        with api.app.db.session() as s:
            node = s.scalar(text("SELECT node_id FROM tasks WHERE id = :t"), {"t": task_id})
        start(api, str(node), task_id)
        placed[str(node)] = group_id
    assert set(placed) == {a, ab}  # spread by memory: one per node

    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    assert sorted(watch_round(api).lost) == ["node-a", "node-ab"]
    api.heartbeat("node-ab")
    assert watch_round(api).back == ["node-ab"]
    backs = [e for e in _node_rows(api) if e.kind == EventKind.NODE_BACK]
    assert [(e.group_id, e.node_id) for e in backs] == [(None, ab), (placed[ab], ab)]


@pytest.mark.feature("E2")
def test_faults_carry_their_node(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    _, task_id = create(api, admin, service_body())
    api.app.scheduler.run_round()
    start(api, node_id, task_id)
    body = {"status": "failed", "message": "gone", "fault": "container_lost"}
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", body)
    assert r.status_code == 200, r.text
    with api.app.db.session() as s:
        fault = s.scalars(select(Event).where(Event.kind == EventKind.CONTAINER_LOST)).one()
        assert fault.node_id == node_id and fault.task_id == task_id
        # state changes are not about a node
        changes = s.scalars(select(Event.node_id).where(Event.kind == EventKind.TASK_STATUS))
        assert set(changes) == {None}


def test_migration_0009_backfills_node_id_on_old_rows(empty_db_url: str) -> None:
    """Rows written by the 0008 code (the node only in the message) get their node_id,
    and the node watch then finishes the story they started."""
    engine = make_engine(empty_db_url)
    try:
        migrate(engine, "0008")
        with engine.begin() as c:
            for nid, name in (("node-000000000001", "n1"), ("node-000000000002", "n2")):
                c.execute(
                    text(
                        "INSERT INTO nodes (id, name, address, runtime, gpus, cpu_count,"
                        " memory_total_mb, memory_available_mb, cpu_percent, memory_percent,"
                        " models, labels, registered_at, last_heartbeat_at) VALUES"
                        " (:id, :name, '127.0.0.1', 'process', '[]', 2, 1024, 1024, 0, 0,"
                        " '[]', '{}', '2026-01-01 00:00:00+00', '2026-01-01 00:10:00+00')"
                    ),
                    {"id": nid, "name": name},
                )
            old = [
                # the 0008 node watch's rows: node-level mark, then one per group
                (None, "fault.node_lost", "node n1 lost: no heartbeat for 61 s (node id "
                 "node-000000000001); 1 task(s) of 1 group(s) affected"),
                ("grp-1", "fault.node_lost", "node n1 lost: no heartbeat for 61 s; "
                 "unreachable: svc-0 (task-1, running)"),
                # an id that no longer exists falls back to the name
                (None, "fault.node_lost", "node n2 lost: no heartbeat for 61 s (node id "
                 "node-000000000099); 0 task(s)"),
                ("grp-2", "fault.node_back", "node gone back: heartbeating again"),
                ("grp-1", "task_status", "node n1 is not what this row is about"),
            ]
            for group_id, kind, message in old:
                c.execute(
                    text(
                        "INSERT INTO events (group_id, task_id, kind, from_status, to_status,"
                        " message, created_at) VALUES (:g, NULL, :k, '', '', :m,"
                        " '2026-01-01 00:05:00+00')"
                    ),
                    {"g": group_id, "k": kind, "m": message},
                )
        migrate(engine)
        migrate(engine)  # idempotent
        with engine.begin() as c:
            got = c.execute(text("SELECT kind, node_id FROM events ORDER BY id")).all()
        assert [tuple(r) for r in got] == [
            ("fault.node_lost", "node-000000000001"),
            ("fault.node_lost", "node-000000000001"),
            ("fault.node_lost", "node-000000000002"),
            ("fault.node_back", None),  # its node is gone: nothing to match it with
            ("task_status", None),
        ]

        # n1 heartbeats again (00:10 is recent at 00:10:05): grp-1 hears it is back
        clock = FakeClock(datetime(2026, 1, 1, 0, 10, 5, tzinfo=UTC))
        db = Database(engine)
        with db.session() as s:
            result = faults.watch_nodes(s, clock, offline_after_s=30)
        assert sorted(result.back) == ["n1", "n2"]
        with db.session() as s:
            told = s.scalars(
                select(Event).where(Event.kind == EventKind.NODE_BACK, Event.group_id == "grp-1")
            ).all()
        assert [(e.node_id, e.from_status, e.to_status) for e in told] == [
            ("node-000000000001", "offline", "online")
        ]
    finally:
        engine.dispose()


class _NoSession:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the session was used ({name}) before the type check")


def test_transition_fields_are_typed() -> None:
    """A wrong field is a mypy error (the ignores below are checked) and a TypeError."""
    s, clock = cast(Session, _NoSession()), cast(Clock, _NoSession())
    with pytest.raises(TypeError, match=r"TaskUpdate\.gpu_ids must be tuple\[int, \.\.\.\]"):
        TaskUpdate(gpu_ids="0,1")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TaskUpdate\.node_id"):
        TaskUpdate(node_id=7)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TaskUpdate\.ports"):
        TaskUpdate(ports=({"container_port": 80, "host_port": 0},))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"TaskUpdate\.memory_mb"):
        TaskUpdate(memory_mb=True)
    with pytest.raises(TypeError, match=r"TaskUpdate\.started_at"):
        TaskUpdate(started_at="2026-01-01")  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # the old spelling: free keyword columns
        transition(
            s, clock, "t", TaskStatus.PENDING, TaskStatus.SCHEDULED,
            node_id="n",  # type: ignore[call-arg]
        )
    with pytest.raises(TypeError, match="update must be a TaskUpdate"):
        transition(
            s, clock, "t", TaskStatus.PENDING, TaskStatus.SCHEDULED,
            update={"node_id": "n"},  # type: ignore[arg-type]
        )
    # what is set is what gets written, in the columns' own form
    when = datetime(2026, 1, 1, tzinfo=UTC) + timedelta(seconds=1)
    u = TaskUpdate(
        node_id=None, gpu_ids=(0, 1), ports=(PortMapping(80, 21000),), started_at=when
    )
    assert u.columns() == {
        "node_id": None,
        "gpu_ids": [0, 1],
        "ports": [{"container_port": 80, "host_port": 21000}],
        "started_at": when,
    }
    assert u.qos is UNSET and TaskUpdate().columns() == {}


def test_wire_values_are_unchanged() -> None:
    """The enums are the same strings on the wire, and refusals read as before."""
    rep = TaskReport.model_validate({"status": "failed", "fault": "engine_exited"})
    assert rep.status == TaskStatus.FAILED and rep.model_dump(mode="json")["fault"] == (
        "engine_exited"
    )
    done = FileRequestDone.model_validate_json('{"status": "done"}')
    assert done.status is FileRequestStatus.DONE
    with pytest.raises(ValueError, match="Input should be 'done' or 'failed'"):
        FileRequestDone.model_validate({"status": "running"})
    with pytest.raises(ValueError, match="Input should be 'running', 'failed', 'stopped'"):
        TaskReport.model_validate({"status": "stopping"})  # only the server stops one
    with pytest.raises(ValueError, match="note 'asleep' goes with status 'sleeping'"):
        TaskReport.model_validate({"status": "sleeping"})  # a note on one, never a move
    assert [k.value for k in EventKind if k.value.startswith("fault.node")] == [
        "fault.node_lost",
        "fault.node_back",
    ]
