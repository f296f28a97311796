"""G2 through the management API: MindIE serves tensor_parallel or split, never pipeline.

The command builders refuse a MindIE pipeline too (tests/unit/test_engine_commands.py);
what the row promises is that the API answers 400 before anything is written.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import func, select

from heteroflow.db.tables import InferenceEndpoint, Task, TaskGroup

from .conftest import Api

MINDIE = "swr.cn-south-1.myhuaweicloud.com/ascendhub/mindie:2.2.rc1-800i-a2-py311"


def mindie(name: str, **over: Any) -> dict[str, Any]:
    task = {"image": MINDIE, "engine": "mindie", "gpu_required": 1, "model_path": "/models/qwen"}
    task.update(over.pop("task", {}))
    return {"name": name, "task": task, **over}


def ascend_nodes(api: Api) -> None:
    cards = [{"index": i, "vendor": "ascend", "model": "910B", "memory_total_mb": 65536}
             for i in range(4)]
    for name in ("ascend-a", "ascend-b"):
        api.heartbeat(name, gpus=cards)


def rows(api: Api) -> list[int]:
    with api.app.db.session() as s:
        return [
            int(s.scalar(select(func.count()).select_from(t)) or 0)
            for t in (TaskGroup, Task, InferenceEndpoint)
        ]


@pytest.mark.feature("G2")
@pytest.mark.parametrize(
    "task_type",
    [
        None,
        "inference",
        "container",
    ],
)
def test_mindie_with_pipeline_is_400_and_writes_nothing(api: Api, task_type: str | None) -> None:
    admin = api.login()  # an operator: pipelines' host network is not what refuses it
    ascend_nodes(api)
    body = mindie("pp", parallelism="pipeline", world_size=2)
    if task_type:
        body["task_type"] = task_type
    for dry in (True, False):
        r = api.client.post(
            f"/api/v1/task-groups{'?dry_run=true' if dry else ''}", json=body, headers=admin
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["field"] == "parallelism", r.text
    assert rows(api) == [0, 0, 0]


@pytest.mark.feature("G2")
def test_mindie_with_tensor_parallel_or_split_is_accepted(api: Api) -> None:
    admin = api.login()
    ascend_nodes(api)
    tp = api.client.post(
        "/api/v1/task-groups",
        json=mindie("tp", parallelism="tensor_parallel", world_size=4),
        headers=admin,
    )
    assert tp.status_code == 201, tp.text
    assert [(t["engine"], t["gpu_required"]) for t in tp.json()["tasks"]] == [("mindie", 4)]
    split = api.client.post(
        "/api/v1/task-groups", json=mindie("split", parallelism="split", world_size=2),
        headers=admin,
    )
    assert split.status_code == 201, split.text
    assert [t["engine"] for t in split.json()["tasks"]] == ["mindie", "mindie"]
