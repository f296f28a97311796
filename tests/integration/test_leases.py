"""Leader election on the database (both databases): the lease compare-and-set, fencing,
concurrent acquisition, and GET /api/v1/servers."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import func, select

from heteroflow.controllers.base import run_tick
from heteroflow.controllers.leadership import Leadership
from heteroflow.controllers.node_watch import NodeWatch
from heteroflow.db.engine import Database, migrate
from heteroflow.db.tables import Base, Event
from heteroflow.services.leadership import (
    CONTROLLERS,
    DbLeaseStore,
    Fence,
    InstanceInfo,
    LeaseLost,
    fenced,
    read_lease,
)

from .conftest import NODE_TOKEN, Api, service_body

T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
TTL = 10.0


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database.from_url(db_url)
    migrate(database.engine)
    yield database
    database.dispose()


def event_count(db: Database, kind: str) -> int:
    with db.session() as s:
        return s.scalar(select(func.count()).select_from(Event).where(Event.kind == kind)) or 0


def test_the_migration_matches_the_tables(db: Database) -> None:
    with db.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert [d for d in diff if {"leases", "server_instances"} & {str(x) for x in _names(d)}] == []


def _names(diff: object) -> Iterator[object]:
    stack = [diff]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(item)
        else:
            yield getattr(item, "name", None)
            yield getattr(getattr(item, "table", None), "name", None)


def test_acquire_renew_refuse_and_take_over(db: Database) -> None:
    store = DbLeaseStore(db)
    assert store.try_acquire_or_renew(CONTROLLERS, "a", T0, TTL) == 1
    assert store.try_acquire_or_renew(CONTROLLERS, "a", at(5), TTL) == 1  # renew: same epoch
    assert store.try_acquire_or_renew(CONTROLLERS, "b", at(6), TTL) is None
    assert store.try_acquire_or_renew(CONTROLLERS, "b", at(15), TTL) is None  # = expires_at
    with db.session() as s:
        lease = read_lease(s, CONTROLLERS)
    assert lease is not None
    assert (lease.holder, lease.epoch, lease.expires_at) == ("a", 1, at(15))

    assert store.try_acquire_or_renew(CONTROLLERS, "b", at(15.5), TTL) == 2  # takeover
    assert store.try_acquire_or_renew(CONTROLLERS, "a", at(16), TTL) is None
    assert store.try_acquire_or_renew(CONTROLLERS, "b", at(20), TTL) == 2
    # a holder that let its own lease lapse, with nobody taking it, keeps its epoch
    assert store.try_acquire_or_renew(CONTROLLERS, "b", at(100), TTL) == 2
    # another lease name is independent
    assert store.try_acquire_or_renew("other", "a", at(100), TTL) == 1


def test_release_lets_another_instance_take_over_at_once(db: Database) -> None:
    store = DbLeaseStore(db)
    assert store.try_acquire_or_renew(CONTROLLERS, "a", T0, TTL) == 1
    store.release(CONTROLLERS, "a", 1, at(1))
    assert store.try_acquire_or_renew(CONTROLLERS, "b", at(1), TTL) == 2
    store.release(CONTROLLERS, "a", 1, at(2))  # no longer a's: changes nothing
    assert store.try_acquire_or_renew(CONTROLLERS, "a", at(2), TTL) is None


def test_the_elector_says_since_when_it_leads(db: Database) -> None:
    """The recovery loop counts a node's silence from then at the earliest."""
    a = Leadership(DbLeaseStore(db), holder="a", ttl_s=TTL, interval_s=1)
    b = Leadership(DbLeaseStore(db), holder="b", ttl_s=TTL, interval_s=1)
    a.reconcile_once(T0)
    a.reconcile_once(at(5))  # renewed in time: the same reign
    assert a.leading_since(at(5)) == T0
    b.reconcile_once(at(5))
    assert b.leading_since(at(5)) is None
    a.reconcile_once(at(30))  # renewed late, but nobody else led in between
    assert a.leading_since(at(30)) == T0
    a.release(at(31))
    b.reconcile_once(at(31))
    assert (a.leading_since(at(31)), b.leading_since(at(32))) == (None, at(31))


def test_a_stale_leaders_fenced_write_is_refused_and_rolled_back(db: Database) -> None:
    store = DbLeaseStore(db)
    assert store.try_acquire_or_renew(CONTROLLERS, "a", T0, TTL) == 1
    mine = Fence(CONTROLLERS, "a", 1)

    with db.session() as s:  # while the lease is a's, its fenced write goes through
        fenced(s, mine, at(1))
        s.add(Event(kind="test.leader_write", message="epoch 1", created_at=at(1)))
    assert event_count(db, "test.leader_write") == 1

    # a pauses past its TTL; b takes over with epoch 2; a wakes and writes
    assert store.try_acquire_or_renew(CONTROLLERS, "b", at(11), TTL) == 2
    with pytest.raises(LeaseLost, match="epoch 1"), db.session() as s:
        s.add(Event(kind="test.leader_write", message="stale", created_at=at(12)))
        s.flush()  # the write reached the database ...
        fenced(s, mine, at(12))  # ... and the check refuses the transaction
    assert event_count(db, "test.leader_write") == 1  # rolled back: nothing written

    # also refused: the right holder with an old epoch, and an expired lease
    with pytest.raises(LeaseLost), db.session() as s:
        fenced(s, Fence(CONTROLLERS, "b", 1), at(12))
    with pytest.raises(LeaseLost), db.session() as s:
        fenced(s, Fence(CONTROLLERS, "b", 2), at(22))
    with pytest.raises(LeaseLost), db.session() as s:
        fenced(s, Fence("never-taken", "b", 1), at(12))
    with db.session() as s:
        fenced(s, Fence(CONTROLLERS, "b", 2), at(21))  # expires_at itself still holds


def test_a_fenced_transaction_holds_off_a_takeover_until_it_commits(db_url: str) -> None:
    """The check's lock orders epochs: writes fenced with epoch 1 commit before epoch 2
    exists, even when the lease expires while they are in flight."""
    ours, theirs = Database.from_url(db_url), Database.from_url(db_url)
    migrate(ours.engine)
    try:
        assert DbLeaseStore(ours).try_acquire_or_renew(CONTROLLERS, "a", T0, TTL) == 1
        took: list[int | None] = []
        started = threading.Event()

        def take_over() -> None:
            started.set()
            took.append(DbLeaseStore(theirs).try_acquire_or_renew(CONTROLLERS, "b", at(11), TTL))

        with ours.session() as s:
            fenced(s, Fence(CONTROLLERS, "a", 1), at(9))
            s.add(Event(kind="test.in_flight", message="epoch 1", created_at=at(9)))
            s.flush()
            thread = threading.Thread(target=take_over)
            thread.start()
            started.wait(5)
            thread.join(0.5)  # the takeover waits for our lock
            assert thread.is_alive() and took == []
        thread.join(30)
        assert took == [2]
        assert event_count(ours, "test.in_flight") == 1  # committed under epoch 1
    finally:
        ours.dispose()
        theirs.dispose()


def race(stores: list[DbLeaseStore], name: str, now: datetime) -> list[int | None]:
    """Every store bids for ``name`` at once (one thread each, own holder id)."""
    barrier = threading.Barrier(len(stores))
    got: list[int | None] = [None] * len(stores)

    def bid(i: int) -> None:
        barrier.wait(5)
        got[i] = stores[i].try_acquire_or_renew(name, f"i{i}-{now.isoformat()}", now, TTL)

    threads = [threading.Thread(target=bid, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_concurrent_acquisition_yields_exactly_one_leader(db_url: str) -> None:
    """Instances (own engines and threads) race for a missing lease, then for an expired
    one: each time exactly one wins, and a takeover adds exactly one epoch."""
    dbs = [Database.from_url(db_url) for _ in range(3)]
    migrate(dbs[0].engine)
    stores = [DbLeaseStore(d) for d in dbs]
    try:
        for round_ in range(10):
            name = f"race-{round_}"
            for now, epoch in ((T0, 1), (at(11), 2)):  # insert race, then takeover race
                got = race(stores, name, now)
                assert sorted(got, key=lambda e: e or 0) == [None, None, epoch], (name, got)
    finally:
        for d in dbs:
            d.dispose()


# -- through the server ------------------------------------------------------------------


class StaleLeadership:
    """A leader paused after reading its fence: it still presents the old token."""

    def __init__(self, fence: Fence) -> None:
        self._fence = fence

    def fence(self, now: datetime) -> Fence | None:
        return self._fence


def _running_task(api: Api) -> None:
    """node-a runs one task of a service (as its agent would report)."""
    admin = api.login()
    node_id = api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin)
    assert r.status_code == 201, r.text
    task_id = r.json()["tasks"][0]["id"]
    assert api.app.scheduler.run_round().placed == 1
    assert api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/claim", {}).status_code == 200
    r = api.agent_post(node_id, f"/api/v1/agent/tasks/{task_id}/report", {"status": "running"})
    assert r.status_code == 200, r.text


def test_a_paused_leaders_node_watch_writes_nothing(api: Api) -> None:
    app, settings = api.app, api.app.settings
    app.leadership.reconcile_once(api.clock.now())
    old = app.leadership.fence(api.clock.now())
    assert old is not None
    _running_task(api)

    # the leader pauses; node-a goes silent; another instance takes the lease over
    api.clock.advance(settings.node_offline_after_s + 1)  # > leader_lease_ttl_s
    other = Leadership(
        DbLeaseStore(app.db), holder="srv-other", ttl_s=settings.leader_lease_ttl_s,
        interval_s=settings.leader_renew_interval_s,
    )
    other.reconcile_once(api.clock.now())
    assert other.fence(api.clock.now()) == Fence(CONTROLLERS, "srv-other", old.epoch + 1)

    kw = {"interval_s": 1.0, "offline_after_s": settings.node_offline_after_s}
    stale = NodeWatch(app.db, api.clock, StaleLeadership(old), **kw)
    with pytest.raises(LeaseLost):
        stale.run_round()
    assert event_count(app.db, "fault.node_lost") == 0

    # the old elector learns it lost: the loop runner no longer runs its node watch
    app.leadership.reconcile_once(api.clock.now())
    assert app.leadership.fence(api.clock.now()) is None
    assert not run_tick(app.node_watch, app.leadership, api.clock.now())

    # the new leader's round writes the fault the stale one could not
    assert NodeWatch(app.db, api.clock, other, **kw).run_round().lost == ["node-a"]
    assert event_count(app.db, "fault.node_lost") == 2  # node-level row + the group's


def test_servers_lists_instances_and_the_leader_for_operators_only(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "acme", "alice")
    app = api.app
    app.leadership.listening_on("127.0.0.1", 4321)
    r = api.client.get("/api/v1/servers", headers=admin)
    assert r.status_code == 200, r.text
    assert r.json() == {"leader": None, "epoch": None, "lease_expires_at": None, "instances": []}

    app.leadership.reconcile_once(api.clock.now())
    body = api.client.get("/api/v1/servers", headers=admin).json()
    me = app.leadership.holder
    assert (body["leader"], body["epoch"]) == (me, 1)
    expires = api.clock.now() + timedelta(seconds=app.settings.leader_lease_ttl_s)
    assert datetime.fromisoformat(body["lease_expires_at"]) == expires
    [inst] = body["instances"]
    assert (inst["id"], inst["pid"], inst["is_leader"]) == (me, os.getpid(), True)
    assert (inst["address"], inst["port"]) == ("127.0.0.1", 4321)

    # another instance shows up; the lease lapses: nobody leads, the epoch stays shown
    there = InstanceInfo(id="srv-other", hostname="elsewhere", pid=1, started_at=T0)
    other = Leadership(
        DbLeaseStore(app.db), holder="srv-other", ttl_s=app.settings.leader_lease_ttl_s,
        interval_s=app.settings.leader_renew_interval_s, instance=there,
    )
    api.clock.advance(app.settings.leader_lease_ttl_s + 1)
    other.store.heartbeat(there, api.clock.now())  # alive, not (yet) bidding
    body = api.client.get("/api/v1/servers", headers=admin).json()
    assert (body["leader"], body["epoch"]) == (None, 1)
    assert [i["id"] for i in body["instances"]] == [me, "srv-other"]
    assert not any(i["is_leader"] for i in body["instances"])

    # an instance silent for 3 TTLs is no longer listed
    api.clock.advance(2 * app.settings.leader_lease_ttl_s)
    other.reconcile_once(api.clock.now())
    body = api.client.get("/api/v1/servers", headers=admin).json()
    assert (body["leader"], body["epoch"]) == ("srv-other", 2)
    assert [(i["id"], i["is_leader"]) for i in body["instances"]] == [("srv-other", True)]

    r = api.client.get("/api/v1/servers", headers=member)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "forbidden"
    assert "operator" in r.json()["error"]["message"]
    assert api.client.get("/api/v1/servers").status_code == 401
    assert api.client.get(
        "/api/v1/servers", headers={"Authorization": f"Bearer {NODE_TOKEN}"}
    ).status_code == 401

