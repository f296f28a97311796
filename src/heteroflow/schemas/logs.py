"""Wire schemas of task logs (C6): agent appends, user reads."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from heteroflow.schemas.common import Strict


class LogAppend(Strict):
    """An agent's new output for one task (size checked in bytes by the service: 413)."""

    text: str


class LogAppended(BaseModel):
    seq: int


class LogChunkRead(BaseModel):
    seq: int
    text: str
    created_at: datetime


class LogPage(BaseModel):
    chunks: list[LogChunkRead]
    next: int  # pass as ?after= to read on; unchanged when nothing new arrived
