"""Start an update (J3).

``start_update`` checks the new generation's task with the create's own rule
(``services.planning.check_task``, via ``check.check_update``: an update that cannot run
— say a custom command where every node runs the process runtime — is refused at the
request, never a 200 that waits for ever; errors name the field), then takes the
rollout's execution lease and bumps the generation in one compare-and-set::

    UPDATE task_groups SET current_generation = g + 1, rollout_holder = :me,
           rollout_expires_at = :now + ttl, rollout_started_at = :now, rollout_spec = ...
     WHERE id = :id AND current_generation = g
       AND (rollout_holder = '' OR rollout_expires_at < :now)

so of two updates submitted at once exactly one starts (the other: 409). ``:me`` is the
server instance that answered the PUT; it drives the rollout (``controllers/rollout.py``).
``current_generation`` counts updates: the number of the newest generation ever started
(a failed update's number is not reused), while each task carries its own generation —
after a rollback the replicas serve the generation they had.

**Quotas (N2).** An update changes no card, memory or replica count, so only a rolling
update's surge is checked: its batch of candidates runs beside the replicas it replaces
and counts against the tenant's quotas meanwhile (409 naming the quota; recreate has no
surge).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta

from sqlalchemy import or_, update
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.containers import DEFAULT_ENV_ALLOW
from heteroflow.core.errors import Conflict
from heteroflow.core.events import EventKind
from heteroflow.core.rollout import (
    Progress,
    RolloutPolicy,
    RolloutState,
    Strategy,
    progress_to_json,
)
from heteroflow.core.states import TaskStatus
from heteroflow.db.tables import Event, TaskGroup
from heteroflow.schemas.task_groups import TaskGroupRead, TaskGroupUpdate
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle.recovery import RUNNING
from heteroflow.services.lifecycle.rollout.check import check_update, describe
from heteroflow.services.lifecycle.rollout.expiry import abandon_expired
from heteroflow.services.lifecycle.rollout.reads import current_tasks
from heteroflow.services.lifecycle.task_groups import get_group
from heteroflow.services.tenancy import quotas

log = logging.getLogger(__name__)


_ASLEEP = frozenset({TaskStatus.SLEEPING, TaskStatus.WAKING})


def start_update(
    s: Session,
    who: Principal,
    clock: Clock,
    group_id: str,
    req: TaskGroupUpdate,
    *,
    holder: str,
    policy: RolloutPolicy,
    env_allow: Sequence[str] = DEFAULT_ENV_ALLOW,
    offline_after_s: float,
) -> TaskGroupRead:
    """Start an update (``PUT .../update``): 404 for a group ``who`` cannot see, 409 while
    another update runs or the service is stopped or asleep, 400 naming a bad field (the
    nodes the create's rule reads are the fleet's, online by ``offline_after_s``)."""
    get_group(s, who, group_id)  # 404 across tenants and for deleted groups
    g = s.get(TaskGroup, group_id, populate_existing=True)
    assert g is not None
    now = clock.now()
    if g.rollout_holder and g.rollout_expires_at is not None and g.rollout_expires_at >= now:
        raise Conflict(
            f"an update to generation {g.current_generation} is already running "
            f"({g.rolling_update_state}: {g.rolling_update_message}); wait for it to end",
        )
    if g.desired != RUNNING:
        raise Conflict(f"service {g.id} is stopped; start it before updating it")
    current = current_tasks(s, g.id)
    if not current:
        raise Conflict(f"service {g.id} has no replica to update")
    asleep = [t.id for t in current if TaskStatus(t.status) in _ASLEEP]
    if asleep:
        raise Conflict(
            f"service {g.id} is asleep ({', '.join(asleep)}); wake it before updating it"
        )
    changes = check_update(s, clock, g, current, req, env_allow, offline_after_s)
    if g.rollout_holder:  # an update whose holder died that the scan has not failed yet
        abandon_expired(s, clock, g, policy)
    gen = g.current_generation
    ranks = sorted({t.rank for t in current})
    gang = g.parallelism == "pipeline"  # issue 32: replaced as a unit, one batch
    p = Progress(
        strategy=Strategy(req.strategy),
        generation=gen + 1,
        from_generation=gen,
        batch_size=len(ranks) if gang else min(req.batch_size, max(1, len(ranks))),
        gang=gang,
        # only a service behind the gateway has requests to finish before a stop
        drain=g.task_type == "inference",
        progress_at=now,  # the progress deadline counts from here (issue 26)
    )
    state = RolloutState.ROLLING if p.strategy == Strategy.ROLLING else RolloutState.RECREATING
    head = max(current, key=lambda t: (t.generation, t.created_at))
    image = changes.get("image")
    if p.strategy == Strategy.RECREATE and image and image != head.image:
        # H7: on the old replicas' nodes before anything stops (core/rollout/forward.py)
        p = replace(p, prepull_image=image)
    if p.strategy == Strategy.ROLLING:
        # N2: a batch's new replicas run beside the old ones; they count meanwhile
        quotas.lock_tenant(s, g.tenant_id)
        quotas.require(
            s, g.tenant_id, quotas.per_replica(head).times(p.batch_size),
            f"a rolling update of a {p.batch_size}-stage gang (the new gang runs beside "
            "the old until it is switched in; strategy recreate needs none)" if gang
            else f"a rolling update in batches of {p.batch_size} (new replicas run beside "
            "the old until they are switched in; strategy recreate needs none)",
        )
    what = describe(head, changes)
    how = (
        f"a new gang of {len(ranks)} stage(s) beside the old, switched as one"
        if p.strategy == Strategy.ROLLING and gang
        else f"batches of {p.batch_size} over {len(ranks)} replica(s)"
        if p.strategy == Strategy.ROLLING
        else f"{len(ranks)} replica(s) stopped, then created"
    )
    message = f"{req.strategy} update to generation {gen + 1} submitted ({how})"
    spec = {
        **progress_to_json(p),
        "changes": changes,
        "by": who.username,
        "submitted_at": now.isoformat(),
    }
    moved = s.execute(
        update(TaskGroup)
        .where(
            TaskGroup.id == g.id,
            TaskGroup.current_generation == gen,
            or_(TaskGroup.rollout_holder == "", TaskGroup.rollout_expires_at < now),
        )
        .values(
            current_generation=gen + 1,
            rollout_holder=holder,
            rollout_expires_at=now + timedelta(seconds=policy.lease_ttl_s),
            rollout_started_at=now,
            rollout_spec=spec,
            rolling_update_state=state.value,
            rolling_update_message=message,
            updated_at=now,
        )
        .execution_options(synchronize_session=False)
    )
    if moved.rowcount != 1:  # type: ignore[attr-defined]
        raise Conflict(f"another update of service {g.id} started first; see its state")
    s.add(
        Event(
            group_id=g.id, task_id=None, kind=EventKind.ROLLOUT_STARTED.value,
            message=f"{message} by {who.username}: {what}", created_at=now,
        )
    )
    log.info("group %s: %s by %s: %s", g.id, message, who.username, what)
    s.flush()
    s.expire_all()
    return get_group(s, who, g.id)
