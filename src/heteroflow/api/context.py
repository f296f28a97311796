"""What every route may use, built once by the composition root (``server.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from heteroflow.core.clock import Clock
from heteroflow.db.engine import Database
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.services.identity.auth import Tokens
from heteroflow.services.tenancy.registry_credentials import Sealer
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
    # C14: a task id -> its engine's key (core.engine_access.engine_key under the
    # platform's engine secret); sent to the task's agent, and to gateways as its auth
    engine_key: Callable[[str], str]
    # H7: seals registry passwords at rest, opens them for the claim of a task
    sealer: Sealer
