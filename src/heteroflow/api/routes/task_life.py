"""Sleep and wake (A8, F1-F3): /api/v1/tasks/{id}/sleep|wake, the same for a whole
service (/api/v1/task-groups/{id}/sleep|wake), and the agent's light poll.

Both answer 202: the state changes now, the engine side follows on the node (the agent
stops or starts the engine within its poll interval). A wake always says which way it
went (``branch``), including the ones that must wait (F3).
"""

from __future__ import annotations

from heteroflow.api.deps import DB, AgentNode, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import IdStr
from heteroflow.schemas.sleep import GroupSleepResult, GroupWakeResult, NodeTaskLife, WakeResult
from heteroflow.schemas.task_groups import TaskRead
from heteroflow.services.lifecycle import sleep

router = api_router(prefix="/api/v1", tags=["task-groups"])


@router.post("/tasks/{task_id}/sleep", response_model=TaskRead, status_code=202)
def sleep_task(task_id: IdStr, ctx: Ctx, s: DB, who: Who) -> TaskRead:
    """A running inference task goes to sleep: no more requests, its engine is stopped
    and its memory released; it keeps its node, cards and slot (409 in any other state)."""
    return sleep.sleep_task(s, ctx.clock, who, task_id)


@router.post("/tasks/{task_id}/wake", response_model=WakeResult, status_code=202)
def wake_task(task_id: IdStr, ctx: Ctx, s: DB, who: Who) -> WakeResult:
    """Wake a sleeping task; ``branch`` says what happens (waking, node_offline,
    card_borrowed, container_gone, ...)."""
    return sleep.wake_task(
        s, ctx.clock, who, task_id, offline_after_s=ctx.settings.node_offline_after_s
    )


@router.post("/task-groups/{group_id}/sleep", response_model=GroupSleepResult, status_code=202)
def sleep_group(group_id: IdStr, ctx: Ctx, s: DB, who: Who) -> GroupSleepResult:
    """Put every running task of an inference service to sleep."""
    return sleep.sleep_group_result(s, ctx.clock, group_id, who=who)


@router.post("/task-groups/{group_id}/wake", response_model=GroupWakeResult, status_code=202)
def wake_group(group_id: IdStr, ctx: Ctx, s: DB, who: Who) -> GroupWakeResult:
    """Wake every current task of an inference service; one result per task."""
    results = sleep.wake_group(
        s, ctx.clock, group_id, who=who, offline_after_s=ctx.settings.node_offline_after_s
    )
    return GroupWakeResult(group_id=group_id, results=results)


@router.get("/agent/task-life", response_model=NodeTaskLife, tags=["agent"])
def task_life(s: DB, node: AgentNode) -> NodeTaskLife:
    """The calling node's sleeping and waking tasks (the agent polls this between
    heartbeats so a sleep or a wake reaches the engine quickly)."""
    return sleep.node_task_life(s, node)
