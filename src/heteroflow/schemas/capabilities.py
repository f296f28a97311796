"""The read form of a service's capabilities (issue 15): shown on model routes and
services. ``null`` means unknown (see ``heteroflow.core.engines.capabilities``)."""

from __future__ import annotations

from pydantic import BaseModel

from heteroflow.core.engines.capabilities import Capabilities


class CapabilitiesRead(BaseModel):
    chat: bool | None = None
    tools: bool | None = None
    vision: bool | None = None
    embeddings: bool | None = None
    json_schema: bool | None = None
    context_length: int | None = None
    embedding_dimensions: int | None = None

    @classmethod
    def of(cls, caps: Capabilities) -> CapabilitiesRead:
        return cls(**caps.to_wire())
