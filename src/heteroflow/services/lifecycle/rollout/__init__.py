"""Rolling update and recreate (J1-J4): start one, drive it a step at a time, and fail
the ones whose holder died. The decisions are ``core/rollout/``'s; this package reads
the facts and writes what it says.

- ``start``: ``start_update`` (J3) — the request checked (``check``), the lease taken and
  the generation bumped in one compare-and-set, a rolling update's surge against quotas;
- ``drive``: ``drive_group`` — one step (J1, J2) fenced by the rollout's lease;
- ``writes``: ``apply`` — one step written: candidates, drains, switches, stops;
- ``expiry``: ``scan`` (J4) — rollouts whose lease lapsed failed, orphaned candidates
  retired;
- ``reads``: the replicas, the groups an instance holds, the gateways' in-flight reports.

**Recovery.** While a rollout holds its lease it owns the group's replicas: the recovery
loop leaves the group alone (services/lifecycle/recovery.py), so a failing new replica is the
rollout's to retry, not a rebuild; afterwards the loop takes over again.
"""

from heteroflow.services.lifecycle.rollout.check import CHANGEABLE
from heteroflow.services.lifecycle.rollout.drive import RolloutLeaseLost, drive_group
from heteroflow.services.lifecycle.rollout.expiry import ScanResult, scan
from heteroflow.services.lifecycle.rollout.reads import (
    InFlightReader,
    gateway_reports,
    held_by,
    no_reports,
)
from heteroflow.services.lifecycle.rollout.start import start_update
from heteroflow.services.lifecycle.rollout.writes import apply

__all__ = [
    "CHANGEABLE",
    "InFlightReader",
    "RolloutLeaseLost",
    "ScanResult",
    "apply",
    "drive_group",
    "gateway_reports",
    "held_by",
    "no_reports",
    "scan",
    "start_update",
]
