"""Publishes the gateway's routing snapshot (every ``snapshot_interval_s``).

The version moves only when the content changes, so a remote gateway's conditional
poll (ETag = version) costs one 304 when nothing happened.

Every instance runs it (``leader_only = False``): each serves its own gateway (and
remote gateways poll whichever instance they reach) from its own in-memory snapshot.

Besides its loop, the embedded gateway may ask for a refresh at once (``refresh``, from
a worker thread) while it holds requests for a waking service (F6), so a lock keeps two
refreshes from publishing two versions of the same content or one version twice.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable
from datetime import datetime

from heteroflow.db.engine import Database
from heteroflow.schemas.routing import RoutingSnapshot, SnapshotHolder
from heteroflow.services.serving.routing import build_snapshot


class SnapshotPublisher:
    name = "snapshot"
    leader_only = False

    def __init__(
        self, db: Database, holder: SnapshotHolder, *, interval_s: float,
        engine_key: Callable[[str], str] | None = None,
    ) -> None:
        self.db = db
        self.engine_key = engine_key  # C14: each backend's key, for the gateways to send
        self.holder = holder
        self.interval_s = interval_s
        self._fingerprint = ""
        self._lock = threading.Lock()

    def reconcile_once(self, now: datetime) -> None:
        self.refresh()

    def refresh(self) -> RoutingSnapshot:
        with self._lock:
            return self._refresh()

    def _refresh(self) -> RoutingSnapshot:
        with self.db.read_snapshot() as s:  # routes, keys and backends of one moment
            snap = build_snapshot(s, self.holder.current.version, self.engine_key)
        wire = snap.to_wire()
        wire.pop("version")
        fp = hashlib.sha256(json.dumps(wire, sort_keys=True).encode()).hexdigest()
        if fp != self._fingerprint:
            self._fingerprint = fp
            snap = RoutingSnapshot(
                version=self.holder.current.version + 1, keys=snap.keys, routes=snap.routes
            )
            self.holder.publish(snap)
        return self.holder.current
