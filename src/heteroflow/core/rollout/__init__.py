"""Rolling update and recreate (J1-J4) as a pure state machine: facts in, one step out.

``services/lifecycle/rollout/`` reads a group's replicas and its rollout's progress (the JSON in
``task_groups.rollout_spec``), calls ``step`` and writes what it says in one transaction
fenced by the rollout's execution lease; the next round reads everything again
(level-triggered), so a round that was lost or refused is simply made again. Nothing
here reads a clock or a database.

Where each part lives:

- ``model``: the replicas, the progress, the policy and the ``Step`` (and what a
  candidate is);
- ``machine``: ``step``, one round — retire what drained, then forward or back;
- ``forward``: the update going forward, rolling (J1) or recreate (J2);
- ``rollback``: a failed update putting the old generation back;
- ``batch``: what both directions share (waits, drains, the switch, an attempt's
  candidates put away);
- ``give_up``: ``abandon`` (J4), ``orphans`` and ``lease_action``;
- ``codec``: the progress as JSON.
"""

from heteroflow.core.rollout.batch import drained, first_line
from heteroflow.core.rollout.codec import progress_from_json, progress_to_json
from heteroflow.core.rollout.forward import batches_total
from heteroflow.core.rollout.give_up import abandon, lease_action, orphans
from heteroflow.core.rollout.machine import step
from heteroflow.core.rollout.model import (
    ACTIVE,
    CANDIDATE,
    Create,
    InFlight,
    Progress,
    Promote,
    Replica,
    RolloutPolicy,
    RolloutState,
    Step,
    Strategy,
)

__all__ = [
    "ACTIVE",
    "CANDIDATE",
    "Create",
    "InFlight",
    "Progress",
    "Promote",
    "Replica",
    "RolloutPolicy",
    "RolloutState",
    "Step",
    "Strategy",
    "abandon",
    "batches_total",
    "drained",
    "first_line",
    "lease_action",
    "orphans",
    "progress_from_json",
    "progress_to_json",
    "step",
]
