"""The pure decisions behind a gang's sleep (issue 32, G3): which stage keeps a gang from
sleeping, how a stage's engine sleeps, and which stage serves (and so opens a door)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from heteroflow.core.engine_access import door_port
from heteroflow.core.engines.sleep import sleep_mode
from heteroflow.db.tables import Task
from heteroflow.services.lifecycle.sleep import gang_sleep_blocker


def stage(rank: int, status: str) -> Task:
    return cast(Task, SimpleNamespace(rank=rank, status=status, id=f"t{rank}"))


@pytest.mark.feature("G3")
@pytest.mark.parametrize(
    ("statuses", "blocker"),
    [
        (["running", "running"], None),
        (["sleeping", "running"], None),  # the rest of a gang half put to sleep
        (["sleeping", "sleeping"], None),
        (["running", "starting"], 1),
        (["waking", "running"], 0),
        (["running", "failed"], 1),
    ],
)
def test_a_gang_sleeps_only_when_every_stage_runs_or_sleeps(
    statuses: list[str], blocker: int | None
) -> None:
    found = gang_sleep_blocker([stage(r, st) for r, st in enumerate(statuses)])
    assert (found.rank if found is not None else None) == blocker


@pytest.mark.feature("G3")
def test_a_pipeline_stage_sleeps_by_stopping_even_where_vllm_would_keep_it() -> None:
    assert sleep_mode("vllm", "nvidia").kept
    mode = sleep_mode("vllm", "nvidia", parallelism="pipeline")
    assert not mode.kept and "pipeline gang" in mode.words()


def test_only_rank_0_of_an_inference_gang_has_a_door() -> None:
    args: dict[str, Any] = {"task_type": "inference", "parallelism": "pipeline"}
    assert door_port(api_host_port=21000, rank=0, **args) == 21000
    assert door_port(api_host_port=21000, rank=1, **args) is None
