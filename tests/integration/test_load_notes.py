"""D5 on the server: how an agent says how a load goes, and a stalled load's fault.

The agent's one door for a task's news is its report: a note (status ``starting`` or
``waking`` with ``note``) changes the task's status message only while the task is in
that state; ``loading`` also writes a ``task.loading`` event, ``progress`` writes none
(it comes every few seconds). A ``failed`` report with ``fault: load_stalled`` writes
``fault.load_stalled`` and counts as a failed start for the recovery loop (E1, E3).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from heteroflow.core.events import EventKind
from heteroflow.core.recovery import Attempt, Rebuild, RecoveryPolicy, decide

from .conftest import Api
from .test_free_ports import claim, create, events, report, task_of


def kinds(api: Api, admin: dict[str, str], group_id: str) -> list[str]:
    return [e["kind"] for e in events(api, admin, group_id)]


@pytest.mark.feature("D5")
def test_a_load_is_noted_on_a_starting_task_and_its_stall_is_a_fault(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id = create(api, admin)
    api.app.scheduler.run_round()
    t = task_of(api, admin, group_id)
    start = {"status": "starting", "note": "loading",
             "message": "loading a 4.5 GB model: expected ~23 s at 200 MB/s"}
    assert report(api, node_id, t["id"], start).status_code == 409  # not claimed yet
    claim(api, node_id, t["id"])
    r = report(api, node_id, t["id"], start)
    assert r.status_code == 200 and r.json()["status"] == "starting", r.text
    assert task_of(api, admin, group_id)["status_message"] == start["message"]
    assert kinds(api, admin, group_id).count("task.loading") == 1
    loaded = [e for e in events(api, admin, group_id) if e["kind"] == "task.loading"]
    assert loaded[0]["message"] == start["message"] and loaded[0]["task_id"] == t["id"]

    before = len(events(api, admin, group_id))
    for done in ("1.2", "2.4"):  # the status message follows; the timeline stays quiet
        note = {"status": "starting", "note": "progress",
                "message": f"loading: {done} of 4.5 GB, ~2 min left"}
        assert report(api, node_id, t["id"], note).status_code == 200
        assert task_of(api, admin, group_id)["status_message"] == note["message"]
    assert len(events(api, admin, group_id)) == before

    # a note names the state it is about: a starting task is not waking
    wrong = {"status": "waking", "note": "progress", "message": "loading: 1 of 2 GB"}
    r = report(api, node_id, t["id"], wrong)
    assert r.status_code == 409 and "cannot note it as waking" in r.text
    stalled = {
        "status": "failed", "fault": "load_stalled",
        "message": "stalled: no progress for 120 s after reading 2.4 of 4.5 GB (its launch); "
                   "last health check: HTTP 503: Loading model",
    }
    assert report(api, node_id, t["id"], stalled).status_code == 200
    t = task_of(api, admin, group_id)
    assert t["status"] == "failed" and t["status_message"] == stalled["message"]
    faults = [e for e in events(api, admin, group_id) if e["kind"] == "fault.load_stalled"]
    assert len(faults) == 1 and faults[0]["message"].endswith(": " + stalled["message"])


@pytest.mark.feature("D5", "F2")
def test_a_waking_task_takes_load_notes_and_bad_notes_are_refused(api: Api) -> None:
    admin = api.login()
    node_id = api.heartbeat()
    group_id = create(api, admin)
    api.app.scheduler.run_round()
    t = task_of(api, admin, group_id)
    claim(api, node_id, t["id"])
    assert report(api, node_id, t["id"], {"status": "running"}).status_code == 200
    assert api.client.post(f"/api/v1/tasks/{t['id']}/sleep", headers=admin).status_code == 202
    assert api.client.post(f"/api/v1/tasks/{t['id']}/wake", headers=admin).status_code == 202
    assert task_of(api, admin, group_id)["status"] == "waking"
    note = {"status": "waking", "note": "loading", "message": "waking a 540 MB model: ~3 s"}
    r = report(api, node_id, t["id"], note)
    assert r.status_code == 200 and r.json()["status"] == "waking", r.text
    assert task_of(api, admin, group_id)["status_message"] == note["message"]
    assert "task.loading" in kinds(api, admin, group_id)
    # the wire says what a note is, naming the field
    bad: list[dict[str, Any]] = [
        {"status": "waking", "message": "no note"},
        {"status": "running", "note": "progress"},
        {"status": "starting", "note": "gossip"},
    ]
    for body in bad:
        r = report(api, node_id, t["id"], body)
        assert r.status_code in (400, 422), (body, r.text)
        assert "note" in r.text, (body, r.text)


def test_a_stalled_load_is_a_failed_start_that_falls_back_to_the_next_engine() -> None:
    """E3 counts fault.load_stalled like any failed start (same engine, same node)."""
    at = datetime(2026, 12, 2, tzinfo=UTC)

    def attempt(task_id: str, count: int) -> Attempt:
        return Attempt(task_id, count, "vllm", "vllm:img", "node-1", None, at,
                       EventKind.LOAD_STALLED)

    history = [attempt("t2", 1), attempt("t1", 0)]
    assert all(a.start_failure for a in history)
    templates = [{"engine": "vllm", "image": "vllm:img"},
                 {"engine": "llamacpp", "image": "llama:img"}]
    d = decide(history, templates, RecoveryPolicy())
    assert isinstance(d, Rebuild) and d.engine == "llamacpp" and d.count == 2
