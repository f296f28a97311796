"""The elector: takes or renews this instance's lease and says whether it leads.

Every server instance runs one ``Leadership`` as an every-instance loop (every
``leader_renew_interval_s``): each round heartbeats the instance's row and asks the
lease store for the ``controllers`` lease (compare-and-set; services/leadership.py).
``run_loop`` runs leader-only controllers only while ``is_leader(now)``, and those
controllers carry ``fence(now)`` into their writes, so a leader that lost the lease
while paused is refused by the database even if it still believes it leads.

Locally the lease counts as held until the ``now`` of the round that took or renewed
it plus the TTL: the same instant the store wrote as ``expires_at``. A failed round
(database unreachable) changes nothing, so leadership lapses on its own when renewals
keep failing.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime, timedelta

from heteroflow.services.leadership import CONTROLLERS, Fence, InstanceInfo, LeaseStore

log = logging.getLogger(__name__)


class Leadership:
    name = "leader-election"
    leader_only = False

    def __init__(
        self,
        store: LeaseStore,
        *,
        holder: str,
        ttl_s: float,
        interval_s: float,
        instance: InstanceInfo | None = None,
        lease: str = CONTROLLERS,
        bids: bool = True,
    ) -> None:
        if not 0 < interval_s < ttl_s:
            raise ValueError(
                f"leader_renew_interval_s ({interval_s}) must be shorter than "
                f"leader_lease_ttl_s ({ttl_s})"
            )
        self.store = store
        self.holder = holder
        self.ttl_s = ttl_s
        self.interval_s = interval_s
        self.instance = instance
        self.lease = lease
        # False: a worker of ``heteroflow server --workers N`` that serves requests only
        # (issue 31): it keeps its row in server_instances but never takes the lease,
        # so the leader-only loops run in the process kept for them, off the request path
        self.bids = bids
        # (epoch, valid until, held since): replaced as a whole, read from other threads
        self._held: tuple[int, datetime, datetime] | None = None

    def listening_on(self, address: str, port: int) -> None:
        """The instance's address, once its socket is bound (shown by GET /servers)."""
        if self.instance is not None:
            self.instance = replace(self.instance, address=address, port=port)

    def reconcile_once(self, now: datetime) -> None:
        if not self.bids:
            if self.instance is not None:
                self.store.heartbeat(self.instance, now)
            return
        epoch = self.store.try_acquire_or_renew(self.lease, self.holder, now, self.ttl_s)
        before = self._held
        taken = epoch is not None and (before is None or before[0] != epoch)
        if epoch is None:
            self._held = None
        else:
            # leading since this round, unless it renewed (same epoch: nobody else led
            # in between, even if the renewal came late)
            since = now if taken or before is None else before[2]
            self._held = (epoch, now + timedelta(seconds=self.ttl_s), since)
        if taken:
            log.info("instance %s leads (lease %s, epoch %d)", self.holder, self.lease, epoch)
        elif epoch is None and before is not None:
            log.warning("instance %s lost the lease %s", self.holder, self.lease)
        if self.instance is not None:
            self.store.heartbeat(self.instance, now)

    def epoch(self, now: datetime) -> int | None:
        held = self._held
        return held[0] if held is not None and now <= held[1] else None

    def leading_since(self, now: datetime) -> datetime | None:
        """When this instance took the lease it holds at ``now`` (None: it does not)."""
        held = self._held
        return held[2] if held is not None and now <= held[1] else None

    def is_leader(self, now: datetime) -> bool:
        return self.epoch(now) is not None

    def fence(self, now: datetime) -> Fence | None:
        """The token for leader-only writes; None unless this instance leads at ``now``."""
        epoch = self.epoch(now)
        return None if epoch is None else Fence(self.lease, self.holder, epoch)

    def release(self, now: datetime) -> None:
        """Hand the lease over at shutdown (after the leader-only loops stopped): another
        instance takes it at its next renew instead of waiting out the TTL."""
        held, self._held = self._held, None
        if held is not None:
            self.store.release(self.lease, self.holder, held[0], now)
            log.info("instance %s released the lease %s", self.holder, self.lease)
