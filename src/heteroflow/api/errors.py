"""Domain errors and bad input -> HTTP, in one place. Never a 500 for bad input.

Shape: ``{"error": {"code", "message", "field"}}``; validation errors name the field
with a dotted path (``task.gpu_required``). Container fields sent at the top level of a
task group get their own message telling where they belong.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from heteroflow.core.errors import DomainError

log = logging.getLogger(__name__)

CONTAINER_FIELDS = frozenset(
    {
        "image",
        "gpu_required",
        "gpu_type",
        "gpu_id",
        "engine",
        "model_path",
        "ports",
        "env",
        "command",
        "engine_args",
        "volumes",
        "memory_mb",
        "estimated_gpu_memory_mb",
    }
)
NOT_ACCEPTED = {
    "co_schedule": "co_schedule is not accepted over HTTP; card sharing is decided by "
    "memory commitment and the per-node container cap",
    "qos": "QoS cannot be requested; it is derived from the node's hardware",
}


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "field": field}}


def _validation_message(err: dict[str, Any]) -> tuple[str, str]:
    raw = list(err.get("loc", ()))
    if raw and raw[0] in ("body", "query", "path", "header"):
        raw = raw[1:]  # where it came from; a field named "path" further on is kept
    loc = [str(p) for p in raw]
    field = ".".join(loc)
    top = loc[0] if len(loc) == 1 else ""
    if err.get("type") == "extra_forbidden":
        if top in CONTAINER_FIELDS:
            return field, f"'{top}' is a container field: put it inside 'task'"
        if top in NOT_ACCEPTED:
            return field, NOT_ACCEPTED[top]
        return field, f"unknown field '{field}'"
    return field, f"{field or 'body'}: {err.get('msg', 'invalid value')}"


def install(app: FastAPI) -> None:
    @app.exception_handler(DomainError)
    async def _domain(_: Request, exc: DomainError) -> JSONResponse:
        return JSONResponse(
            error_body(exc.code, exc.message, exc.field),
            status_code=exc.status,
            headers=exc.headers,
        )

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = list(exc.errors())
        if not errors:
            return JSONResponse(error_body("validation_error", "invalid request"), 400)
        # Container fields at the top level are the most useful thing to say first.
        errors.sort(key=lambda e: e.get("type") != "extra_forbidden")
        field, message = _validation_message(errors[0])
        return JSONResponse(
            error_body("validation_error", message, field or None), status_code=400
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            error_body(code, str(exc.detail)), status_code=exc.status_code, headers=exc.headers
        )
