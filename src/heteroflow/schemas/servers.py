"""Wire schemas of ``GET /api/v1/servers``: server instances and who leads (issue 11)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class ServerInstanceRead(BaseModel):
    id: str  # new at every process start; the lease's holder when it leads
    hostname: str
    pid: int
    address: str  # "" until the instance listens
    port: int  # 0 until the instance listens
    version: str
    started_at: datetime
    last_seen_at: datetime  # its last heartbeat (every leader_renew_interval_s)
    is_leader: bool


class ServersRead(BaseModel):
    # the instance holding the "controllers" lease (running the leader-only loops);
    # null while nobody holds an unexpired lease
    leader: str | None
    # the lease's fencing epoch and expiry as last written (also while it is expired);
    # null before any instance ever took it
    epoch: int | None
    lease_expires_at: datetime | None
    instances: list[ServerInstanceRead]  # seen within 3 lease TTLs, oldest start first
