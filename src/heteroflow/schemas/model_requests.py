"""Wire schemas of the ``heteroflow models`` verbs (issue 29, H9): the nodes' cached
models as one list, an operator's pull or eviction on one node, and the agent's side
(claim, report)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, Field, StringConstraints

from heteroflow.core.model_requests import Action, ModelRequestStatus, Reported
from heteroflow.schemas.common import MAX_INT64, SafeStr, ScrubbedStr, Strict, no_nul
from heteroflow.schemas.nodes import PeerCopy

# A cache key as the agent makes it (``ModelSource.cache_key``: the kind, a slug, a
# digest). It starts with a letter or digit: ``.``/``..`` and the cache's own folders
# (``.incoming``, ``.trash``) are never a key, so an eviction cannot name them.
KEY_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,119}$"
ModelKey = Annotated[
    str, StringConstraints(max_length=120, pattern=KEY_PATTERN), AfterValidator(no_nul)
]
# What names a node in a path: its id (node-…) or its name (the heartbeat's rule).
NodeRef = Annotated[
    str,
    StringConstraints(min_length=1, max_length=253, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$"),
    AfterValidator(no_nul),
]


class CachedModelRead(BaseModel):
    """One model revision a node holds or is downloading, as its last heartbeat said."""

    node_id: str
    node: str  # the node's name
    key: str
    source: str
    revision: str
    size_bytes: int  # on disk; fetched so far while downloading
    state: str  # complete | downloading


class ModelPull(Strict):
    # the form is core.model_requests.pull_source's (one parser); this bound only stops
    # absurd bodies early
    source: SafeStr = Field(max_length=4096)


class ModelEvict(Strict):
    key: ModelKey


class ModelRequestRead(BaseModel):
    id: str
    node_id: str
    node: str
    action: Action
    source: str
    key: str
    status: ModelRequestStatus
    message: str
    done_bytes: int
    total_bytes: int
    requested_by: str
    created_at: datetime
    updated_at: datetime


class AgentModelRequest(BaseModel):
    """A request the agent claimed (pending -> running) and must now carry out; a pull
    names the nodes that hold a copy (as a launch's claim does: ``services.agents.copies``)
    so the node copies it from the fleet before it asks the origin."""

    id: str
    action: Action
    source: str
    key: str
    peers: list[PeerCopy] = Field(default_factory=list)


class ModelRequestReport(Strict):
    """The agent's word on a running request: progress (``running``) or its end. ``key``:
    the cache key a pull resolved to (known once the source is resolved)."""

    status: Reported
    message: ScrubbedStr = Field(default="", max_length=8192)
    done_bytes: int = Field(default=0, ge=0, le=MAX_INT64)
    total_bytes: int = Field(default=0, ge=0, le=MAX_INT64)
    key: ModelKey | Literal[""] = ""
