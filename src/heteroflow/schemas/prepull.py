"""A recreate's pre-pull (J2, H7) on the agent's channel: what the server asks a node's
agent to pull (``GET /api/v1/agent/prepulls``) and the agent's answer for one replica
(``POST /api/v1/agent/tasks/{id}/prepull``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from heteroflow.schemas.common import SafeStr, ScrubbedStr, Strict
from heteroflow.schemas.registry_credentials import RegistryAuth

PrepullOutcome = Literal["pulled", "failed", "unavailable"]


class PrepullAsk(BaseModel):
    """Make ``image`` present on this node for the update of ``task_id``'s service."""

    task_id: str
    image: str
    # the pull's login, to the agent of the node that holds the task only (as a claim's)
    registry_auth: RegistryAuth | None = Field(default=None, repr=False)


class PrepullReport(Strict):
    image: SafeStr = Field(max_length=512)
    # pulled (present now); failed (may heal: asked again); unavailable (not found,
    # unauthorised: the update fails with nothing stopped)
    outcome: PrepullOutcome
    message: ScrubbedStr = Field(default="", max_length=8192)
