"""Wire schema of ``GET /api/v1/engines``: each engine's capabilities and their maturity
(FEATURES H8; the labels live in ``core.engines.maturity``)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Label = Literal["verified-ci-cpu", "verified-gpu", "built-unverified"]


class CapabilityRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str = Field(description="chat, tools, embeddings, metrics, sleep, cpu, kv_offload, "
                      "shape:<parallelism>, gpu:<vendor>")
    label: Label = Field(
        description="verified-ci-cpu: run for real in this project's CI on the CPU; "
        "verified-gpu: run for real on a GPU; built-unverified: the code exists, never run "
        "against the real engine"
    )
    description: str
    evidence: str = Field(default="", description="the test that runs it (verified labels)")
    note: str = ""


class EngineRead(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    name: str
    vendors: list[str]
    explicit_only: bool = Field(description="chosen only when named (never by a chain)")
    capabilities: list[CapabilityRead]
