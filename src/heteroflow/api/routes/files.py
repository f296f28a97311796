"""File requests: users create and read them (/api/v1/file-requests); agents claim,
upload chunks and finish them (/api/v1/agent/file-requests)."""

from __future__ import annotations

import asyncio
from typing import Annotated
from urllib.parse import quote

from fastapi import Header, Request
from fastapi.responses import StreamingResponse

from heteroflow.api.deps import DB, AgentNode, Ctx, Who
from heteroflow.api.routes.logs import read_capped
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.common import MAX_INT32, IdStr
from heteroflow.schemas.files import (
    AgentFileRequest,
    FileRequestCreate,
    FileRequestCreated,
    FileRequestDone,
    FileRequestRead,
)
from heteroflow.services.agents import files

router = api_router(prefix="/api/v1", tags=["file-requests"])


@router.post("/file-requests", response_model=FileRequestCreated, status_code=201)
def create_request(req: FileRequestCreate, ctx: Ctx, s: DB, who: Who) -> FileRequestCreated:
    return files.create(s, who, ctx.clock, req)


@router.get("/file-requests/{request_id}", response_model=FileRequestRead)
def get_request(request_id: IdStr, ctx: Ctx, s: DB, who: Who) -> FileRequestRead:
    return files.get(s, who, ctx.clock, request_id, ctx.settings.file_request_timeout_s)


@router.get(
    "/file-requests/{request_id}/content",
    response_class=StreamingResponse,
    responses={
        200: {"content": {"application/octet-stream": {}}},
        409: {"description": "not done (yet)"},
    },
)
def get_content(request_id: IdStr, ctx: Ctx, s: DB, who: Who) -> StreamingResponse:
    name, size = files.content_of(
        s, who, ctx.clock, request_id, ctx.settings.file_request_timeout_s
    )
    return StreamingResponse(
        files.iter_chunks(ctx.db, request_id),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(size),
            "Content-Disposition": f"attachment; filename*=UTF-8''{quote(name)}",
        },
    )


@router.get("/agent/file-requests", response_model=list[AgentFileRequest], tags=["agent"])
def claim_requests(ctx: Ctx, s: DB, node: AgentNode) -> list[AgentFileRequest]:
    """Pending requests for this node's tasks, claimed by this call (each one only once)."""
    return files.claim_pending(s, ctx.clock, node)


@router.post("/agent/file-requests/{request_id}/chunks", tags=["agent"])
async def upload_chunk(
    request_id: IdStr,
    request: Request,
    ctx: Ctx,
    node: AgentNode,
    x_chunk_seq: Annotated[int, Header(ge=0, le=MAX_INT32)],
) -> dict[str, int]:
    limit = ctx.settings.file_chunk_bytes
    data = await read_capped(request, limit, "chunk")

    def _store() -> int:
        with ctx.db.session() as s:
            return files.store_chunk(
                s,
                ctx.clock,
                node,
                request_id,
                x_chunk_seq,
                data,
                ctx.settings.file_request_max_bytes,
            )

    return {"received_bytes": await asyncio.to_thread(_store)}


@router.post("/agent/file-requests/{request_id}/done", tags=["agent"])
def finish_request(
    request_id: IdStr, done: FileRequestDone, ctx: Ctx, s: DB, node: AgentNode
) -> dict[str, str]:
    return {"status": files.finish(s, ctx.clock, node, request_id, done)}
