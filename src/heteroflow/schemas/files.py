"""Wire schemas of file requests (C7): user create/read and the agent's side."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from heteroflow.core.states import FileOutcome, FileRequestStatus
from heteroflow.schemas.common import (
    ID_PATTERN,
    MAX_ID_LENGTH,
    MAX_INT64,
    SafeStr,
    ScrubbedStr,
    Strict,
)

RequestType = Literal["list", "download"]


class FileRequestCreate(Strict):
    task_id: SafeStr = Field(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN)
    request_type: RequestType
    # The byte limit (4096, UTF-8) and the path rules are checked by core.paths so the
    # message names them; this bound only stops absurd bodies early.
    target_path: SafeStr = Field(max_length=8192)


class FileRequestCreated(BaseModel):
    id: str
    status: FileRequestStatus


MAX_LIST_ENTRIES = 10000


class FileEntry(BaseModel):
    # an agent's listing entry (strict per field; also read back from stored rows)
    name: ScrubbedStr = Field(max_length=4096, strict=True)  # undecodable names: U+FFFD
    size: int = Field(ge=0, le=MAX_INT64, strict=True)
    is_dir: bool = Field(strict=True)
    mtime: float = Field(ge=-1e12, le=1e12, allow_inf_nan=False, strict=True)


class ListResult(BaseModel):
    """A directory listing (non-recursive); ``truncated`` past MAX_LIST_ENTRIES."""

    entries: list[FileEntry] = Field(default_factory=list, max_length=MAX_LIST_ENTRIES)
    truncated: bool = Field(default=False, strict=True)


class FileRequestRead(BaseModel):
    id: str
    task_id: str
    request_type: str
    target_path: str
    status: FileRequestStatus
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
    status: FileOutcome
    error: ScrubbedStr = Field(default="", max_length=8192)
    result: ListResult | None = None
    size_bytes: int = Field(default=0, ge=0, le=MAX_INT64)
