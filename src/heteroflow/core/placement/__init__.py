"""Placement: pure filters, scorers and choices over plain values (no I/O).

- ``model``: the views (cards, nodes, occupants), the demand and ``book``;
- ``filters``: card and node admission (B1, B3, B6), host ports (P2);
- ``scoring``: the scorer plugins, the card choice, QoS (H5);
- ``pipeline``: ``place`` for one task, ``place_gang`` for all-or-nothing groups (G1);
- ``preemption``: which lower-priority tasks make room (B4);
- ``fleet``: the per-round index that keeps a decision O(sample) on large fleets;
- ``reasons``: the readable pending reason (B2, B5); ``precheck``: B8.
"""

from heteroflow.core.placement.fleet import FleetIndex
from heteroflow.core.placement.model import (
    DEFAULT_CPU_TASK_MEMORY_MB,
    CardView,
    NodeView,
    Occupant,
    Placement,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
    unbook_occupant,
)
from heteroflow.core.placement.pipeline import Policy, evaluate, place, place_gang
from heteroflow.core.placement.precheck import never_fits
from heteroflow.core.placement.preemption import Preemption, plan_preemption
from heteroflow.core.placement.scoring import parse_scorers, qos

__all__ = [
    "DEFAULT_CPU_TASK_MEMORY_MB",
    "CardView",
    "FleetIndex",
    "NodeView",
    "Occupant",
    "Placement",
    "Policy",
    "Preemption",
    "Reservation",
    "TaskDemand",
    "Unplaced",
    "book",
    "evaluate",
    "never_fits",
    "parse_scorers",
    "place",
    "place_gang",
    "plan_preemption",
    "qos",
    "unbook_occupant",
]
