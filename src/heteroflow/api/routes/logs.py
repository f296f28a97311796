"""Task logs: agents append (/api/v1/agent/tasks/{id}/logs), users read or follow them."""

from __future__ import annotations

import asyncio

from fastapi import Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import StreamingResponse
from pydantic import ValidationError

from heteroflow.api.deps import DB, AgentNode, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.core.errors import PayloadTooLarge
from heteroflow.schemas.common import MAX_INT32, IdStr
from heteroflow.schemas.logs import LogAppend, LogAppended, LogPage
from heteroflow.services.agents import logs
from heteroflow.services.identity.access import visible_task

router = api_router(prefix="/api/v1", tags=["logs"])


async def read_capped(request: Request, limit: int, what: str) -> bytes:
    """The request body, refused with 413 as soon as it exceeds ``limit`` bytes."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"{what} is {declared} bytes; at most {limit}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise PayloadTooLarge(f"{what} is over {limit} bytes")
    return bytes(body)


@router.post(
    "/agent/tasks/{task_id}/logs", response_model=LogAppended, status_code=201, tags=["agent"]
)
async def append_logs(task_id: IdStr, request: Request, ctx: Ctx, node: AgentNode) -> LogAppended:
    settings = ctx.settings
    # JSON escapes take at most 6 bytes per byte of text: bound the raw body by that.
    raw = await read_capped(request, 6 * settings.log_append_max_bytes + 4096, "log body")
    try:
        req = LogAppend.model_validate_json(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None

    def _append() -> int:
        with ctx.db.session() as s:
            return logs.append(
                s,
                ctx.clock,
                node,
                task_id,
                req.text,
                max_bytes=settings.log_append_max_bytes,
                keep_bytes=settings.task_log_max_bytes,
            )

    return LogAppended(seq=await asyncio.to_thread(_append))


@router.get(
    "/tasks/{task_id}/logs",
    response_model=LogPage,
    responses={200: {"content": {"text/plain": {}}, "description": "follow=true: live text"}},
)
def read_logs(
    task_id: IdStr,
    ctx: Ctx,
    s: DB,
    who: Who,
    after: int = Query(
        default=0, ge=0, le=MAX_INT32, description="return chunks with seq > after"
    ),
    limit: int = Query(default=100, ge=1, le=1000),
    follow: bool = Query(default=False, description="stream new text until the task ends"),
) -> LogPage | StreamingResponse:
    if not follow:
        return logs.read(s, who, task_id, after, limit)
    visible_task(s, who, task_id)
    return StreamingResponse(
        logs.follow(
            ctx.db,
            task_id,
            after,
            poll_s=ctx.settings.log_follow_poll_s,
            timeout_s=ctx.settings.log_follow_timeout_s,
        ),
        media_type="text/plain; charset=utf-8",
    )
