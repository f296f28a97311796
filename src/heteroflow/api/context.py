"""What every route may use, built once by the composition root (``server.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.services.auth import Tokens
from heteroflow.settings import ServerSettings


@dataclass(frozen=True, slots=True)
class ServerContext:
    settings: ServerSettings
    db: Database
    clock: Clock
    tokens: Tokens
    holder: SnapshotHolder
    node_token: str
    gateway_token: str
