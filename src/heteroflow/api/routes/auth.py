"""POST /api/v1/auth/login (throttled per user name and per client address)."""

from __future__ import annotations

from fastapi import Request

from heteroflow.api.deps import Ctx
from heteroflow.api.unit_of_work import api_router
from heteroflow.core.auth_policy import LoginBackoff
from heteroflow.schemas.auth import LoginRequest, LoginResponse
from heteroflow.services.identity import login as logins

router = api_router(prefix="/api/v1/auth", tags=["auth"])


@router.post(
    "/login",
    response_model=LoginResponse,
    responses={
        401: {"description": "wrong username or password"},
        429: {"description": "too many failed logins; see Retry-After"},
    },
)
def login(req: LoginRequest, request: Request, ctx: Ctx) -> LoginResponse:
    st = ctx.settings
    backoff = LoginBackoff(
        base_s=st.login_backoff_base_s,
        max_s=st.login_backoff_max_s,
        forget_s=st.login_throttle_forget_s,
    )
    address = request.client.host if request.client else ""
    # The service opens its own units of work: a failure must be counted (committed)
    # although the answer is an error.
    token = logins.login(
        ctx.db, ctx.tokens, ctx.clock, backoff, req.username, req.password, address
    )
    return LoginResponse(access_token=token, expires_in=int(st.jwt_ttl_s))
