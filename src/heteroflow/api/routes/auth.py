"""POST /api/v1/auth/login."""

from __future__ import annotations

from fastapi import APIRouter

from heteroflow.api.deps import DB, Ctx
from heteroflow.schemas.auth import LoginRequest, LoginResponse
from heteroflow.services import auth

router = APIRouter(prefix="/api/v1/auth", tags=["auth"])


@router.post("/login", response_model=LoginResponse)
def login(req: LoginRequest, ctx: Ctx, s: DB) -> LoginResponse:
    token = auth.login(s, ctx.tokens, req.username, req.password)
    return LoginResponse(access_token=token, expires_in=int(ctx.settings.jwt_ttl_s))
