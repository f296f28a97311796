"""Which nodes a task's model can be copied from (issue 29 item 4, FEATURES H9).

A node that needs a model another node holds copies it from that node's agent rather
than from the source's origin, so a fleet fetches each model from outside once — and an
air-gapped fleet fetches it from the one node an operator loaded it onto. The claim
reply names the holders (``TaskAssignment.model_peers``): nodes other than the claimer
whose agent serves its cache (a ``peer_url``), that beat within the offline delay, and
whose last report lists a complete copy of the task's source (``copy_matches``: its
text, its pinned text, or ``fleet://<key>``). At most ``MAX_PEERS``, ordered by
rendezvous hashing of (task, node) so that ten nodes fetching one model spread over its
holders instead of all asking the first; the agent tries them in order.

Read at claim time only (a few a minute, not per heartbeat): the holders' ``models``
column is parsed here, once per claim.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.placement.model import cached_copies, source_text
from heteroflow.core.placement.scoring import copy_matches
from heteroflow.db.tables import Node
from heteroflow.schemas.nodes import PeerCopy

__all__ = ["MAX_PEERS", "model_peers"]

MAX_PEERS = 3


def model_peers(
    s: Session, clock: Clock, node_id: str, task_id: str, model_path: str,
    *, offline_after_s: float,
) -> list[PeerCopy]:
    source = source_text(model_path)
    if not source:
        return []
    cutoff = clock.now() - timedelta(seconds=offline_after_s)
    rows = s.execute(
        select(Node.name, Node.peer_url, Node.models).where(
            Node.id != node_id, Node.peer_url != "", Node.last_heartbeat_at >= cutoff,
        )
    ).all()
    found: list[PeerCopy] = []
    for name, url, models in rows:
        for c in cached_copies(models or []):
            if c.complete and c.key and copy_matches(c, source):
                found.append(PeerCopy(node=name, url=url, key=c.key))
                break
    found.sort(key=lambda p: hashlib.sha256(f"{task_id}/{p.node}".encode()).digest())
    return found[:MAX_PEERS]
