"""Wire schemas of a service's LoRA adapters (/api/v1/task-groups/{id}/adapters)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from heteroflow.schemas.common import SafeStr, Strict
from heteroflow.schemas.task_groups import ModelNameStr


class AdapterCreate(Strict):
    """An adapter to serve beside the service's base model, under its own model name."""

    name: ModelNameStr = Field(
        description="the model name callers use for it: unique among the tenant's model "
        "names, as a model name is"
    )
    path: SafeStr = Field(
        max_length=4096,
        description="the adapter's folder (adapter_config.json + weights): absolute, inside "
        "the allowed volume prefixes of a node you may use (as task.model_path); in a "
        "container, under one of the task's volumes",
    )


class AdapterRead(BaseModel):
    name: str
    path: str


class AdaptersRead(BaseModel):
    """A service's adapters and how many its engines hold at once."""

    group_id: str
    max_loras: int
    adapters: list[AdapterRead]
