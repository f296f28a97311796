"""Leases on the database: leader election with a fencing token (issue 11, item 5).

A lease is one ``leases`` row: ``name`` (``controllers``: who runs the leader-only
loops), ``holder`` (a server instance id, new at every process start), ``epoch`` and
``expires_at``. Every instance's elector (``controllers/leadership.py``) calls
``try_acquire_or_renew`` every ``leader_renew_interval_s``; it is one compare-and-set::

    UPDATE leases SET holder = :me, expires_at = :now + ttl, renewed_at = :now,
           epoch = CASE WHEN holder = :me THEN epoch ELSE epoch + 1 END
     WHERE name = :name AND (holder = :me OR expires_at < :now)

so the holder renews (same epoch) and anybody takes over an expired lease (epoch + 1).
A missing row is inserted with epoch 1; of two instances inserting at once the primary
key lets one win (the other's ``IntegrityError`` means "someone else leads"). The same
rule as a pure function is ``next_lease`` (the in-memory fake in ``testing/`` uses it).

Why the epoch is a fencing token. Expiry alone cannot stop a leader that was paused
(GC, a stopped VM, a slow disk) after it last checked its lease: it wakes up believing
it still leads and writes. So every leader-only write carries the epoch it was granted:
``fenced(s, fence, now)`` runs, in the same transaction and before the write,
``UPDATE leases SET renewed_at = renewed_at WHERE name AND holder AND epoch AND
expires_at >= now`` and raises ``LeaseLost`` unless exactly one row matched — the
transaction then rolls back and nothing of the write remains. The UPDATE is the lock:
on PostgreSQL it takes the lease row's lock (as ``SELECT ... FOR UPDATE`` would; an
UPDATE conflicts with the takeover's UPDATE just the same), on SQLite the database
write lock. One statement, one code path, tested on both databases.

What it guarantees: all writes fenced with epoch N commit before the lease can move to
epoch N + 1 (the takeover's UPDATE waits for the fenced transaction's lock, and then
sees the row unchanged), and once epoch N + 1 exists no write fenced with N commits
(its check no longer matches). So leader-only writes from two epochs never interleave,
whatever the clocks or pauses. What it does not: writes that skip ``fenced`` (the
every-instance loops, the API) are not ordered by it; they must be safe on every
instance on their own (compare-and-set, ``SKIP LOCKED``).

Also here: the ``server_instances`` heartbeat and the operators' ``GET /api/v1/servers``
view. Services hold this because they are the only code that changes state and the only
code the routes call; ``db/`` stays schema and engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from sqlalchemy import case, delete, literal, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from heteroflow.core.errors import Forbidden
from heteroflow.db.engine import Database
from heteroflow.db.tables import Lease, ServerInstance
from heteroflow.schemas.servers import ServerInstanceRead, ServersRead
from heteroflow.services.identity.auth import Principal

log = logging.getLogger(__name__)

CONTROLLERS = "controllers"  # the lease the leader-only loops run under
# Instances not seen for this long are deleted from server_instances (a restart gets a
# new id, so rows of past processes would pile up otherwise).
FORGET_INSTANCES_AFTER = timedelta(days=1)


class LeaseLost(Exception):
    """The lease is not (or no longer) ours with this epoch: the write is refused."""


@dataclass(frozen=True, slots=True)
class LeaseInfo:
    holder: str
    epoch: int
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Fence:
    """The fencing token a leader-only write carries: lease name, holder and epoch."""

    name: str
    holder: str
    epoch: int


@dataclass(frozen=True, slots=True)
class InstanceInfo:
    """What a server instance says about itself in ``server_instances``."""

    id: str
    hostname: str
    pid: int
    started_at: datetime
    version: str = ""
    address: str = ""
    port: int = 0


class LeaseStore(Protocol):
    """Where leases live: ``DbLeaseStore`` here, ``InMemoryLeaseStore`` in testing/."""

    def try_acquire_or_renew(
        self, name: str, holder: str, now: datetime, ttl_s: float
    ) -> int | None:
        """The epoch now held by ``holder``, or None when another holds the lease."""
        ...

    def release(self, name: str, holder: str, epoch: int, now: datetime) -> None:
        """Let the lease expire at ``now`` if still held (a clean shutdown's handover)."""
        ...

    def heartbeat(self, instance: InstanceInfo, now: datetime) -> None:
        """Record that ``instance`` is alive at ``now``."""
        ...


def next_lease(
    current: LeaseInfo | None, holder: str, now: datetime, ttl_s: float
) -> LeaseInfo | None:
    """The compare-and-set rule as a pure function: the lease after ``holder`` asks for
    it at ``now``, or None when refused (another holder's lease has not expired)."""
    expires = now + timedelta(seconds=ttl_s)
    if current is None:
        return LeaseInfo(holder, 1, expires)
    if current.holder == holder:
        return LeaseInfo(holder, current.epoch, expires)
    if current.expires_at < now:
        return LeaseInfo(holder, current.epoch + 1, expires)
    return None


def fence_holds(current: LeaseInfo | None, fence: Fence, now: datetime) -> bool:
    """What ``fenced`` checks, as a pure function."""
    return (
        current is not None
        and current.holder == fence.holder
        and current.epoch == fence.epoch
        and current.expires_at >= now
    )


class DbLeaseStore:
    """Leases in the ``leases`` table, on SQLite or PostgreSQL."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def try_acquire_or_renew(
        self, name: str, holder: str, now: datetime, ttl_s: float
    ) -> int | None:
        mine = Lease.holder == holder
        taken_at = literal(now, Lease.acquired_at.type)  # UTC-normalised like the column
        cas = (
            update(Lease)
            .where(Lease.name == name, or_(mine, Lease.expires_at < now))
            .values(
                # SET expressions read the row as it was: `holder` is the old holder
                epoch=case((mine, Lease.epoch), else_=Lease.epoch + 1),
                acquired_at=case((mine, Lease.acquired_at), else_=taken_at),
                holder=holder,
                expires_at=now + timedelta(seconds=ttl_s),
                renewed_at=now,
            )
            .execution_options(synchronize_session=False)
        )
        with self.db.session() as s:
            if s.execute(cas).rowcount == 1:  # type: ignore[attr-defined]
                return int(s.scalars(select(Lease.epoch).where(Lease.name == name)).one())
            if s.get(Lease, name) is not None:
                return None  # another holder's lease has not expired
        try:
            with self.db.session() as s:
                s.add(
                    Lease(
                        name=name,
                        holder=holder,
                        epoch=1,
                        expires_at=now + timedelta(seconds=ttl_s),
                        acquired_at=now,
                        renewed_at=now,
                    )
                )
        except IntegrityError:
            return None  # another instance inserted it first: it leads
        return 1

    def release(self, name: str, holder: str, epoch: int, now: datetime) -> None:
        with self.db.session() as s:
            s.execute(
                update(Lease)
                .where(Lease.name == name, Lease.holder == holder, Lease.epoch == epoch)
                .values(expires_at=now - timedelta(microseconds=1))
                .execution_options(synchronize_session=False)
            )

    def heartbeat(self, instance: InstanceInfo, now: datetime) -> None:
        with self.db.session() as s:
            row = s.get(ServerInstance, instance.id)
            if row is None:
                s.add(
                    ServerInstance(
                        id=instance.id,
                        hostname=instance.hostname,
                        pid=instance.pid,
                        address=instance.address,
                        port=instance.port,
                        version=instance.version,
                        started_at=instance.started_at,
                        last_seen_at=now,
                    )
                )
                # a new instance is rare: the moment to forget long-gone ones
                s.execute(
                    delete(ServerInstance).where(
                        ServerInstance.last_seen_at < now - FORGET_INSTANCES_AFTER
                    )
                )
            else:
                row.address, row.port = instance.address, instance.port
                row.last_seen_at = now


def fenced(s: Session, fence: Fence, now: datetime) -> None:
    """Refuse this unit of work unless ``fence`` still holds the lease (see the module).

    Call it in the session of a leader-only write, before writing: it locks the lease
    row (PostgreSQL) or the database (SQLite) until commit, so the lease cannot change
    hands before this transaction ends. Raises ``LeaseLost`` (the caller's session
    then rolls back) when the lease moved on, expired, or never was ours.
    """
    res = s.execute(
        update(Lease)
        .where(
            Lease.name == fence.name,
            Lease.holder == fence.holder,
            Lease.epoch == fence.epoch,
            Lease.expires_at >= now,
        )
        .values(renewed_at=Lease.renewed_at)
        .execution_options(synchronize_session=False)
    )
    if res.rowcount != 1:  # type: ignore[attr-defined]
        raise LeaseLost(
            f"lease {fence.name!r} epoch {fence.epoch} is no longer held by {fence.holder}"
        )


def read_lease(s: Session, name: str) -> LeaseInfo | None:
    row = s.get(Lease, name)
    return None if row is None else LeaseInfo(row.holder, row.epoch, row.expires_at)


def list_servers(s: Session, who: Principal, now: datetime, seen_within_s: float) -> ServersRead:
    """Instances seen within ``seen_within_s``, the leader (None while the lease is
    expired or was never taken), and the lease's last epoch and expiry."""
    if not who.is_operator:
        raise Forbidden("only a platform operator lists server instances")
    lease = read_lease(s, CONTROLLERS)
    leader = lease.holder if lease is not None and lease.expires_at >= now else None
    rows = s.scalars(
        select(ServerInstance)
        .where(ServerInstance.last_seen_at >= now - timedelta(seconds=seen_within_s))
        .order_by(ServerInstance.started_at, ServerInstance.id)
    )
    return ServersRead(
        leader=leader,
        epoch=lease.epoch if lease else None,
        lease_expires_at=lease.expires_at if lease else None,
        instances=[
            ServerInstanceRead(
                id=r.id,
                hostname=r.hostname,
                pid=r.pid,
                address=r.address,
                port=r.port,
                version=r.version,
                started_at=r.started_at,
                last_seen_at=r.last_seen_at,
                is_leader=r.id == leader,
            )
            for r in rows
        ],
    )
