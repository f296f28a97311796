"""Row -> wire conversions (the API never returns ORM objects).

The read models take their columns from the row by name (pydantic's
``from_attributes``); only what a read computes or hides is written here.
"""

from __future__ import annotations

from heteroflow.core.engines.capabilities import UNKNOWN, Capabilities
from heteroflow.db.tables import InferenceEndpoint, ModelRoute, Task, TaskGroup
from heteroflow.schemas.capabilities import CapabilitiesRead
from heteroflow.schemas.gateway import EndpointRead, ModelRouteRead
from heteroflow.schemas.task_groups import TaskGroupRead, TaskRead
from heteroflow.services.serving.capabilities import of_tasks


def task_read(t: Task) -> TaskRead:
    return TaskRead.model_validate(t, from_attributes=True)


def group_read(g: TaskGroup, tasks: list[Task]) -> TaskGroupRead:
    current = sorted((t for t in tasks if not t.replaced_by), key=lambda t: (t.generation, t.rank))
    return TaskGroupRead.model_validate(g, from_attributes=True).model_copy(
        update={
            "tasks": [task_read(t) for t in current],
            "capabilities": CapabilitiesRead.of(of_tasks(tasks)),
        }
    )


def endpoint_read(e: InferenceEndpoint, *, shared: bool = False) -> EndpointRead:
    """``shared``: its group is another tenant's, read by a member: its id is not shown
    (issue 26; ``endpoints.foreign_groups``)."""
    read = EndpointRead.model_validate(e, from_attributes=True)
    return read.model_copy(update={"group_id": ""}) if shared else read


def route_read(
    r: ModelRoute, capabilities: Capabilities = UNKNOWN, *, shared: bool = False
) -> ModelRouteRead:
    """``shared``: as ``endpoint_read``'s."""
    hidden = {"group_id": ""} if shared else {}
    return ModelRouteRead.model_validate(r, from_attributes=True).model_copy(
        update={**hidden, "capabilities": CapabilitiesRead.of(capabilities)}
    )
