"""GET /api/v1/servers: the server instances and which one leads, for operators."""

from __future__ import annotations

from heteroflow.api.deps import DB, Ctx, Who
from heteroflow.api.unit_of_work import api_router
from heteroflow.schemas.servers import ServersRead
from heteroflow.services import leadership

router = api_router(prefix="/api/v1", tags=["servers"])


@router.get("/servers", response_model=ServersRead)
def list_servers(s: DB, ctx: Ctx, who: Who) -> ServersRead:
    # an instance heartbeats every renew; three TTLs leave room for a slow one
    seen_within_s = 3 * ctx.settings.leader_lease_ttl_s
    return leadership.list_servers(s, who, ctx.clock.now(), seen_within_s)
