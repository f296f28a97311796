"""Wire schemas of the platform switches (L1) and of a create's dedup answer (L2-L4).

``PUT /api/v1/platform-settings`` takes only the switches it knows (unknown keys: 400
naming the field); fields left out keep their value. A create (and its dry run) that
reused an existing service carries a ``DedupRead``: which group, what was done to it,
and a message and level a console shows as they are.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from heteroflow.schemas.common import Strict
from heteroflow.schemas.sleep import WakeResult

DedupLevel = Literal["info", "success", "warning"]
# reused: the group runs (callable at once); woken: it slept and is waking now;
# wake_requested: it sleeps and cannot wake yet (node offline, card borrowed), recorded
DedupAction = Literal["reused", "woken", "wake_requested"]


class PlatformSettingsRead(BaseModel):
    inference_dedup_enabled: bool = Field(
        default=False,
        description="a create of a model already served (same model_path and image, "
        "running or sleeping) reuses that service instead of starting another (L1, L2)",
    )
    cross_tenant_dedup_enabled: bool = Field(
        default=False,
        description="dedup also reuses services of tenants in the caller's sharing group "
        "(L4); needs inference_dedup_enabled",
    )


class PlatformSettingsUpdate(Strict):
    inference_dedup_enabled: bool | None = None
    cross_tenant_dedup_enabled: bool | None = None


class DedupRead(BaseModel):
    """What a create did instead of starting a new service (or, in a dry run, would do)."""

    reused: bool = True
    action: DedupAction
    level: DedupLevel = Field(
        description="success: callable now; info: waking; warning: the wake must wait"
    )
    message: str
    group_id: str = Field(
        description="the reused service; empty when it is another tenant's (a member is "
        "not told whose: issue 26; operators are)"
    )
    group_status: str = Field(description="its status after this create")
    cross_tenant: bool = Field(description="the service belongs to another tenant")
    model_name: str = Field(description="the name the caller calls it by")
    route_id: str | None = Field(
        default=None,
        description="the caller's route to it (added, or the one it already had); "
        "null in a dry run",
    )
    route_added: bool = Field(default=False, description="this create added the route")
    endpoint_id: str | None = Field(
        default=None, description="the caller's new endpoint; its key is the answer's api_key"
    )
    wake: list[WakeResult] = Field(
        default_factory=list,
        description="one result per task when it had to be woken (not for another "
        "tenant's service: its tasks are not yours to see; the message says what happens)",
    )
