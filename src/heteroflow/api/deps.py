"""Dependencies: the context, a unit of work, and who is calling."""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Header, Request
from sqlalchemy.orm import Session

from heteroflow.api.context import ServerContext
from heteroflow.core.errors import Unauthorized
from heteroflow.services.agents.node_tokens import NodeTokens
from heteroflow.services.identity.auth import Principal, authenticate


def get_ctx(request: Request) -> ServerContext:
    ctx: ServerContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServerContext, Depends(get_ctx)]


def get_session(ctx: Ctx) -> Iterator[Session]:
    with ctx.db.session() as s:
        yield s


# scope="function": the unit of work commits when the route function returns, before
# the response is sent — so a 201 means the row is committed, and a commit that fails
# is the caller's error answer, never a success followed by lost data. (FastAPI's
# default "request" scope would commit after the response went out.) Streaming routes
# open their own sessions from ctx.db.
DB = Annotated[Session, Depends(get_session, scope="function")]


def _bearer(authorization: str | None) -> str:
    if not authorization or not authorization.lower().startswith("bearer "):
        raise Unauthorized("missing Authorization: Bearer <token>")
    return authorization[7:].strip()


def _authenticate(ctx: ServerContext, token: str) -> Principal:
    """The token's checks plus one read of its user (still there, same role and tenant,
    not revoked). Sync on purpose: FastAPI runs it in the threadpool."""
    with ctx.db.session() as s:
        return authenticate(s, ctx.tokens, token)


def get_principal(
    request: Request, ctx: Ctx, authorization: Annotated[str | None, Header()] = None
) -> Principal:
    principal = _authenticate(ctx, _bearer(authorization))
    request.state.principal = principal  # the audit log names who made a write
    return principal


Who = Annotated[Principal, Depends(get_principal)]


def get_node_id(
    request: Request,
    ctx: Ctx,
    authorization: Annotated[str | None, Header()] = None,
    x_heteroflow_node: Annotated[str | None, Header()] = None,
) -> str:
    """Agents authenticate with the node token and name their node id in a header.

    During a rotation the previous token works too, until it expires or the rotation is
    finished (``NodeTokens``, built by the composition root; an API built without one
    checks its context's fixed token).
    """
    token = _bearer(authorization)
    node_tokens: NodeTokens | None = getattr(request.app.state, "node_tokens", None)
    if node_tokens is not None:
        ok = node_tokens.check(token, x_heteroflow_node or "") is not None
    else:
        ok = hmac.compare_digest(token.encode(), ctx.node_token.encode())
    if not ok:
        raise Unauthorized("invalid node token")
    request.state.actor = "agent"  # the audit log skips the agent's own calls
    return x_heteroflow_node or ""


AgentNode = Annotated[str, Depends(get_node_id)]


def require_gateway(
    request: Request, ctx: Ctx, authorization: Annotated[str | None, Header()] = None
) -> None:
    """The routing snapshot holds key hashes: only gateways and operators may read it."""
    token = _bearer(authorization)
    if ctx.gateway_token and hmac.compare_digest(token.encode(), ctx.gateway_token.encode()):
        request.state.actor = "gateway"  # the audit log skips the gateway's usage posts
        return
    principal = _authenticate(ctx, token)
    if not principal.is_operator:
        raise Unauthorized("the routing snapshot is for gateways and operators")
    request.state.principal = principal  # the audit log names who made a write
