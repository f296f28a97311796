"""What a rollout works with: the replicas it reads, the progress it keeps between rounds
(``task_groups.rollout_spec``), its policy and the ``Step`` it answers with.

**Candidates.** A rollout's new replicas are *candidates*: ``tasks.replaced_by`` holds
``CANDIDATE`` (not a task id), so they are not current — the group's derived status,
its reads and the recovery loop see only the replicas that serve — but the routing
snapshot routes every ``running`` task, so a candidate takes requests as soon as its
first health check passed. A batch *switches* a rank (``Promote``) in one transaction:
the old replica's ``replaced_by`` becomes the candidate's id, the candidate's becomes
"" (current), and the old replica is asked to stop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from heteroflow.core.events import EventKind
from heteroflow.core.states import TERMINAL, TaskStatus, WireEnum

# ``tasks.replaced_by`` of a rollout's new replica until its batch switches it in
CANDIDATE = "candidate"


class RolloutState(WireEnum):
    """``task_groups.rolling_update_state`` (NULL: never updated)."""

    ROLLING = "rolling"  # a rolling update runs
    RECREATING = "recreating"  # a recreate runs
    ROLLING_BACK = "rolling_back"  # a failed update puts the old generation back
    DONE = "done"  # the last update finished: every replica runs its generation
    FAILED = "failed"  # the last update failed (rolled back, or abandoned); resubmit it


ACTIVE = frozenset({RolloutState.ROLLING, RolloutState.RECREATING, RolloutState.ROLLING_BACK})


class Strategy(WireEnum):
    ROLLING = "rolling"
    RECREATE = "recreate"


@dataclass(frozen=True, slots=True)
class RolloutPolicy:
    ready_timeout_s: float = 300.0  # a batch's candidates run within this, else it failed
    settle_s: float = 2.0  # candidates run this long before the old replicas drain
    drain_min_s: float = 2.0  # a draining replica stops no sooner (every gateway saw it)
    drain_timeout_s: float = 30.0  # ... and no later, requests in flight or not
    batch_retries: int = 3  # a failed batch is tried again this many times
    lease_ttl_s: float = 60.0  # the execution lease (J4)
    renew_s: float = 15.0  # renewed this often
    max_hold_s: float = 960.0  # held at most this long (16 min)
    progress_deadline_s: float = 600.0  # no batch switched this long: it fails, rolls back
    # D5: a candidate whose agent said it is loading (or pulling its image) within this
    # is making progress — its agent notes how far every few seconds and fails a load
    # that stalls itself — so neither ready_timeout_s nor progress_deadline_s counts it
    load_news_s: float = 60.0

    @property
    def attempts(self) -> int:
        return 1 + self.batch_retries


@dataclass(frozen=True, slots=True)
class Replica:
    """One task of the group as the machine sees it."""

    id: str
    rank: int
    generation: int
    status: TaskStatus
    replaced_by: str  # "" = current; CANDIDATE = a rollout's new replica; else a task id
    draining: bool = False
    running_at: datetime | None = None
    message: str = ""  # its status message (why it failed)
    # H7: it failed because its image cannot be pulled until a person acts (not found,
    # unauthorised: ``fault.image_unavailable``): trying the batch again changes nothing
    unpullable: bool = False
    # D5 / H7: what its agent last said it does before it serves — "loading" (its load
    # window is open) or "pulling" (its image) — and when its agent last said anything
    # about it; "" / None: nothing said (pending, or a launch with no load window)
    busy: str = ""
    news_at: datetime | None = None
    # recreate: its agent's word on the new image on its node during this update —
    # "pulled", "failed" (may heal: asked again) or "unavailable" (not found,
    # unauthorised); "" = none yet — and the words that came with it
    prepull: str = ""
    prepull_message: str = ""
    # issue 32: it serves the API (``core.gang.serves_api``): a gang's headless stage
    # takes no request, so it has nothing to drain and stops at once
    serves: bool = True

    @property
    def current(self) -> bool:
        return self.replaced_by == ""

    @property
    def candidate(self) -> bool:
        return self.replaced_by == CANDIDATE

    @property
    def live(self) -> bool:
        """Not ended and not on its way out."""
        return self.status not in TERMINAL and self.status != TaskStatus.STOPPING


@dataclass(frozen=True, slots=True)
class Progress:
    """What a rollout remembers between rounds (``task_groups.rollout_spec``, with the
    update's changes, which only the service reads)."""

    strategy: Strategy
    generation: int  # the generation it rolls to
    from_generation: int
    batch_size: int = 1
    rolling_back: bool = False
    reason: str = ""  # why it rolls back
    batch: tuple[int, ...] = ()  # the ranks in progress
    candidates: Mapping[int, str] = field(default_factory=dict)  # rank -> task id
    attempt: int = 1
    batch_since: datetime | None = None  # this attempt's candidates were created
    drain_since: datetime | None = None  # the batch's old replicas were marked draining
    old_stopped: bool = False  # recreate: the old generation was told to stop
    drain: bool = True  # old replicas drain before they stop (False: nothing routes to them)
    given_up: tuple[int, ...] = ()  # rollback: ranks whose restore failed
    retiring: Mapping[str, datetime] = field(default_factory=dict)  # task -> draining since
    batches_done: int = 0
    progress_at: datetime | None = None  # it started, or a batch last switched
    # recreate (J2, H7): the new image, made present on the nodes of the old replicas
    # before any of them drains ("" = nothing to pull: the image did not change)
    prepull_image: str = ""
    prepulled: bool = False
    # issue 32: a pipeline gang, replaced as a unit — every stage in one batch, and an
    # attempt that fails rolls back at once (a second attempt of the same generation
    # would meet the first one's stages at its rendezvous while they retire)
    gang: bool = False


@dataclass(frozen=True, slots=True)
class Create:
    """A candidate for ``rank``: a copy of task ``source`` — with the update's changes
    (forward) or as it was (``restore``: the rollback)."""

    rank: int
    source: str
    restore: bool = False


@dataclass(frozen=True, slots=True)
class Promote:
    """Switch ``rank`` to ``candidate``; ``olds`` (its current replicas) stop."""

    rank: int
    candidate: str
    olds: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Step:
    progress: Progress
    state: RolloutState
    message: str  # rolling_update_message: where it stands, for people
    create: tuple[Create, ...] = ()
    drain: tuple[str, ...] = ()
    undrain: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    promote: tuple[Promote, ...] = ()
    events: tuple[tuple[EventKind, str], ...] = ()
    finished: bool = False  # the lease is released (state DONE or FAILED)


# task id -> (requests in flight on it, as of when) from the gateways' reports
InFlight = Mapping[str, tuple[int, datetime]]
