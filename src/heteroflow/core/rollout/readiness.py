"""When a batch's candidate is late (J1, J2 with D5): readiness follows loading.

A candidate not running ``ready_timeout_s`` after its attempt began is late — unless its
agent says it is loading its model (or pulling its image) and said so within
``load_news_s``: a 70B model loads for minutes, and the agent already watches that load
(core/loading.py) — it fails one that stops making progress (``fault.load_stalled``) or
passes its ceiling, and notes how far it got every few seconds while it moves. So a
loading candidate is judged by its agent, not by a fixed limit here; one whose agent went
quiet (a lost node, a dead agent) counts against ``ready_timeout_s`` again. The same rule
keeps ``progress_deadline_s`` from failing an update whose candidates all still load.
"""

from __future__ import annotations

from datetime import datetime

from heteroflow.core.rollout.model import Replica, RolloutPolicy
from heteroflow.core.states import TaskStatus


def progressing(c: Replica, now: datetime, policy: RolloutPolicy) -> bool:
    """Its agent said within ``load_news_s`` that it is loading (or pulling)."""
    if c.status == TaskStatus.RUNNING or not c.busy or c.news_at is None:
        return False
    return (now - c.news_at).total_seconds() < policy.load_news_s


def late(c: Replica, since: datetime, now: datetime, policy: RolloutPolicy) -> str | None:
    """Why a candidate whose attempt began at ``since`` is late now (None: it is not) —
    the words say which case: it is not loading, or its load went quiet."""
    if c.status == TaskStatus.RUNNING or not c.live:
        return None
    waited = (now - since).total_seconds()
    if waited < policy.ready_timeout_s or progressing(c, now, policy):
        return None
    limit = f"not running and healthy within {policy.ready_timeout_s:g} s"
    if c.busy and c.news_at is not None:
        quiet = (now - c.news_at).total_seconds()
        return (
            f"{limit}: it was {c.busy} but its agent has said nothing of it for "
            f"{quiet:.0f} s (more than {policy.load_news_s:g} s)"
        )
    return f"{limit} and not loading (its agent reports no load)"
