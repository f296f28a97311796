"""bench/cold_start.py --source (issue 29): how a create → first token splits into its
phases from the task's events, for a cold node (the model fetched) and a warm one (the
node's cache had it), on fixed event lists."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from .bench_module import load_bench

cs = load_bench("cold_start")

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC).timestamp()  # the create was sent


def at(s: float) -> str:
    return datetime.fromtimestamp(T0 + s, UTC).isoformat().replace("+00:00", "Z")


def status(s: float, to: str, task: str | None = "task-1") -> dict[str, Any]:
    kind = "task_status" if task else "group_status"
    return {"kind": kind, "task_id": task, "to_status": to, "message": "", "created_at": at(s)}


def note(s: float, kind: str, message: str = "") -> dict[str, Any]:
    return {"kind": kind, "task_id": "task-1", "to_status": "", "message": message,
            "created_at": at(s)}


COLD = [
    status(0.5, "scheduled"),
    status(0.6, "scheduling", task=None),  # a group's row: not the task's phase
    status(2.5, "starting"),
    note(3.0, "task.model_fetch", "fetching model …"),
    note(13.0, "task.model_fetch", "fetched model …"),
    note(13.25, "task.loading"),
    status(15.25, "running"),
]


def test_a_cold_node_splits_into_place_claim_prepare_download_load_health_first_token() -> None:
    got = cs.node_phases(list(reversed(COLD)), T0, T0 + 15.5, T0 + 15.75)  # any order
    assert got == {
        "place_s": 0.5, "claim_s": 2.0, "prepare_s": 0.75, "download_s": 10.0,
        "copy_s": None, "load_s": 2.0, "health_s": 0.25, "first_token_s": 0.25,
        "total_s": 15.75, "cached": False,
    }
    # the phases are the whole of it: they add up to create → first token
    assert sum(got[k] or 0 for k in cs.NODE_PHASES) == pytest.approx(got["total_s"])


def test_a_warm_node_downloads_nothing_and_its_prepare_is_the_rest_before_the_launch() -> None:
    warm = [status(0.5, "scheduled"), status(1.0, "starting"), note(1.5, "task.loading"),
            status(3.0, "running")]
    got = cs.node_phases(warm, T0, T0 + 3.25, T0 + 3.5)
    assert (got["cached"], got["download_s"], got["prepare_s"], got["load_s"]) == (
        True, 0.0, 0.5, 1.5)
    assert sum(got[k] or 0 for k in cs.NODE_PHASES) == pytest.approx(got["total_s"])


def test_a_relaunch_moves_no_phase_and_an_unfinished_fetch_is_unknown_not_zero() -> None:
    relaunched = [*COLD, status(20.0, "starting"), note(20.5, "task.loading"),
                  status(22.0, "running")]
    assert cs.node_phases(relaunched, T0, T0 + 22.5, T0 + 23.0)["load_s"] == 2.0
    cut = [status(0.5, "scheduled"), status(2.5, "starting"),
           note(3.0, "task.model_fetch", "fetching model …")]
    got = cs.node_phases(cut, T0, T0 + 30.0, T0 + 31.0)
    assert (got["download_s"], got["prepare_s"], got["load_s"], got["cached"]) == (
        None, None, None, False)


def test_the_table_shows_every_phase_with_a_dash_where_there_is_none() -> None:
    runs = {"cold": {**cs.node_phases(COLD, T0, T0 + 15.5, T0 + 15.75), "model_gets": 1},
            "warm": {"total_s": 3.5, "download_s": 0.0, "model_gets": 0}}
    rows = {line.split()[0]: line.split()[1:] for line in cs.table(runs).splitlines()}
    assert rows["download_s"] == ["10.00", "0.00"]
    assert rows["copy_s"] == ["—", "—"]
    assert rows["model_gets"] == ["1", "0"]
