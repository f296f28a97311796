"""Wire schemas of task logs (C6): agent appends, user reads."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from heteroflow.schemas.common import ScrubbedStr, Strict


class LogAppend(Strict):
    """An agent's new output for one task (size checked in bytes by the service: 413).

    Engines may write NUL bytes or undecodable text: they become U+FFFD (PostgreSQL text
    cannot hold NUL) rather than losing the chunk. The raw body is capped by the route;
    this bound only keeps the schema honest."""

    text: ScrubbedStr = Field(max_length=64 * 1024 * 1024)


class LogAppended(BaseModel):
    seq: int


class LogChunkRead(BaseModel):
    seq: int
    text: str
    created_at: datetime


class LogPage(BaseModel):
    chunks: list[LogChunkRead]
    next: int  # pass as ?after= to read on; unchanged when nothing new arrived
