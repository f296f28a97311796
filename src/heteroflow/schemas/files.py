"""Wire schemas of file requests (C7): user create/read and the agent's side."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from heteroflow.schemas.common import Strict

RequestType = Literal["list", "download"]


class FileRequestCreate(Strict):
    task_id: str = Field(min_length=1, max_length=64)
    request_type: RequestType
    # The byte limit (4096, UTF-8) and the path rules are checked by core.paths so the
    # message names them; this bound only stops absurd bodies early.
    target_path: str = Field(max_length=8192)


class FileRequestCreated(BaseModel):
    id: str
    status: str


MAX_LIST_ENTRIES = 10000


class FileEntry(BaseModel):
    name: str = Field(max_length=4096)
    size: int = Field(ge=0)
    is_dir: bool
    mtime: float


class ListResult(BaseModel):
    """A directory listing (non-recursive); ``truncated`` past MAX_LIST_ENTRIES."""

    entries: list[FileEntry] = Field(default_factory=list, max_length=MAX_LIST_ENTRIES)
    truncated: bool = False


class FileRequestRead(BaseModel):
    id: str
    task_id: str
    request_type: str
    target_path: str
    status: Literal["pending", "running", "done", "failed"]
    error: str
    entries: list[FileEntry] | None = Field(
        default=None, description="list requests, once done: the directory's entries"
    )
    truncated: bool = False
    size_bytes: int
    created_at: datetime
    updated_at: datetime


class AgentFileRequest(BaseModel):
    """A request the agent claimed (pending -> running) and must now serve."""

    id: str
    task_id: str
    request_type: RequestType
    target_path: str


class FileRequestDone(Strict):
    status: Literal["done", "failed"]
    error: str = Field(default="", max_length=8192)
    result: ListResult | None = None
    size_bytes: int = Field(default=0, ge=0)
