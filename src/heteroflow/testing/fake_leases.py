"""An in-memory ``LeaseStore`` for unit tests: the same compare-and-set rule, no database.

It applies ``services.leadership.next_lease`` (the rule the SQL implements) to a dict,
so tests of the elector and the loop runner step a FakeClock without any I/O. The
integration tests hold ``DbLeaseStore`` to the same behaviour on both databases.
"""

from __future__ import annotations

import threading
from datetime import datetime, timedelta

from heteroflow.services.leadership import (
    Fence,
    InstanceInfo,
    LeaseInfo,
    fence_holds,
    next_lease,
)


class InMemoryLeaseStore:
    def __init__(self) -> None:
        self.leases: dict[str, LeaseInfo] = {}
        self.instances: dict[str, tuple[InstanceInfo, datetime]] = {}  # id -> (info, seen)
        self.fail = False  # True: every call raises, as an unreachable database would
        self._lock = threading.Lock()

    def _check(self) -> None:
        if self.fail:
            raise ConnectionError("lease store unreachable (fake)")

    def try_acquire_or_renew(
        self, name: str, holder: str, now: datetime, ttl_s: float
    ) -> int | None:
        self._check()
        with self._lock:
            new = next_lease(self.leases.get(name), holder, now, ttl_s)
            if new is None:
                return None
            self.leases[name] = new
            return new.epoch

    def release(self, name: str, holder: str, epoch: int, now: datetime) -> None:
        self._check()
        with self._lock:
            cur = self.leases.get(name)
            if cur is not None and (cur.holder, cur.epoch) == (holder, epoch):
                self.leases[name] = LeaseInfo(holder, epoch, now - timedelta(microseconds=1))

    def heartbeat(self, instance: InstanceInfo, now: datetime) -> None:
        self._check()
        with self._lock:
            self.instances[instance.id] = (instance, now)

    def holds(self, fence: Fence, now: datetime) -> bool:
        """What ``fenced`` would answer for a write carrying ``fence`` at ``now``."""
        with self._lock:
            return fence_holds(self.leases.get(fence.name), fence, now)
