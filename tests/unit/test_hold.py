"""Holding requests until their model is routable (``gateway.routing.hold.RoutableHold``):
F6, a sleeping model (woken first), and M17, a model whose replicas are starting, with a
fake server link. Durations are tenths of a second of the event loop's own clock; the
wall clock that says how long replicas have been starting is a fake one."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import orjson
import pytest

from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.routing.hold import (
    CLIENT_LEFT,
    Ready,
    Refused,
    RoutableHold,
    asleep,
    hold_reason,
    starting_for,
)
from heteroflow.schemas.routing import (
    Backend,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    WakeOutcome,
)

TENANT, MODEL = "tn-1", "chat"


NOW = 1_000_000.0  # the fake wall clock (epoch s)


def _snap(
    version: int,
    *,
    asleep: str = "",
    backends: int = 0,
    starting: int = 0,
    starting_since: float = 0.0,
    draining: bool = False,
) -> RoutingSnapshot:
    target = RouteTarget(
        "r-1",
        "tg-1",
        0,
        1,
        tuple(
            Backend(f"task-{i}", f"http://h:{i}", group_id="tg-1", draining=draining)
            for i in range(backends)
        ),
        asleep=asleep,
        starting=starting,
        starting_since=starting_since,
    )
    return RoutingSnapshot(version=version, routes={(TENANT, MODEL): (target,)})


class FakeLink:
    def __init__(self, holder: SnapshotHolder, branch: str = "waking", message: str = "") -> None:
        self.holder = holder
        self.branch = branch
        self.message = message
        self.calls: list[tuple[list[str], str]] = []
        self.refreshes = 0
        self.fail = False
        self.delay = 0.0

    async def wake(self, group_ids: Sequence[str], model: str) -> list[WakeOutcome]:
        self.calls.append((list(group_ids), model))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise OSError("server away")
        return [WakeOutcome(g, "task-0", self.branch, self.message) for g in group_ids]

    async def refresh(self) -> None:
        self.refreshes += 1

    async def aclose(self) -> None:
        pass


def _hold(
    holder: SnapshotHolder,
    link: FakeLink | None,
    *,
    hold_s: float = 5.0,
    start_hold_s: float = 5.0,
) -> tuple[RoutableHold, GatewayMetrics]:
    metrics = GatewayMetrics()
    return (
        RoutableHold(
            holder,
            link,
            metrics,
            hold_s=hold_s,
            start_hold_s=start_hold_s,
            retry_after_s=7,
            poll_s=0.01,
            now=lambda: NOW,
        ),
        metrics,
    )


def _targets(holder: SnapshotHolder) -> tuple[RouteTarget, ...]:
    return holder.current.routes[TENANT, MODEL]


def _error(r: object) -> dict[str, object]:
    assert isinstance(r, Refused), r
    assert r.error.status == 503
    assert r.headers() == [(b"retry-after", b"7")]
    err = orjson.loads(r.error.body())["error"]
    assert isinstance(err, dict)
    return err


@pytest.mark.feature("F6")
async def test_the_request_is_held_until_a_backend_is_up_then_routed() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    link = FakeLink(holder)
    hold, metrics = _hold(holder, link)
    assert asleep(_targets(holder))
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder)))
    await asyncio.sleep(0.05)
    assert not task.done() and metrics.held == {MODEL: 1}
    assert link.calls == [(["tg-1"], MODEL)]
    holder.publish(_snap(2, asleep="waking"))
    await asyncio.sleep(0.05)
    assert not task.done()
    up = _snap(3, backends=1)
    holder.publish(up)
    result = await asyncio.wait_for(task, 1)
    assert isinstance(result, Ready) and result.snapshot is up
    assert link.refreshes > 0  # it asked for fresh snapshots while holding
    assert metrics.held == {MODEL: 0} and metrics.holds == {(MODEL, "ready"): 1}
    assert metrics.wakes == {(MODEL, "waking"): 1}
    assert hold.holds_in_progress == 0
    text = metrics.render().decode()
    assert 'heteroflow_gateway_wake_holds_total{model="chat",outcome="ready"} 1' in text
    assert 'heteroflow_gateway_wakes_total{model="chat",branch="waking"} 1' in text
    assert 'heteroflow_gateway_held_requests{model="chat"} 0' in text
    assert 'heteroflow_gateway_wake_hold_seconds_count{model="chat"} 1' in text


@pytest.mark.feature("F6")
async def test_hold_timeout_is_503_with_retry_after() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    hold, metrics = _hold(holder, FakeLink(holder), hold_s=0.1)
    result = await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 2)
    err = _error(result)
    assert err["code"] == "model_waking"
    assert "not ready within 0.1 s" in str(err["message"])
    assert metrics.holds == {(MODEL, "timeout"): 1}
    await asyncio.sleep(0.05)
    assert hold.holds_in_progress == 0  # nobody waits: the shared wake ended too


@pytest.mark.feature("F6")
async def test_holding_off_answers_503_at_once_and_the_wake_is_started() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    link = FakeLink(holder)
    hold, metrics = _hold(holder, link, hold_s=0)
    result = await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 1)
    err = _error(result)
    assert err["code"] == "model_waking"
    assert "retry in 7 s" in str(err["message"])
    assert link.calls == [(["tg-1"], MODEL)]
    assert metrics.holds == {(MODEL, "not_held"): 1}
    # once the snapshot says waking, later requests do not ask again
    holder.publish(_snap(2, asleep="waking"))
    await asyncio.sleep(0)
    again = await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 1)
    assert _error(again)["code"] == "model_waking"
    assert len(link.calls) == 1


@pytest.mark.feature("F6")
async def test_concurrent_requests_share_one_wake() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    link = FakeLink(holder)
    link.delay = 0.05  # the server takes a moment: everyone arrives meanwhile
    hold, metrics = _hold(holder, link)
    tasks = [
        asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder))) for _ in range(20)
    ]
    await asyncio.sleep(0.1)
    assert metrics.held == {MODEL: 20} and hold.holds_in_progress == 1
    holder.publish(_snap(2, backends=2))
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert all(isinstance(r, Ready) for r in results)
    assert len(link.calls) == 1
    assert metrics.holds == {(MODEL, "ready"): 20}


@pytest.mark.feature("F6")
async def test_concurrent_requests_with_holding_off_share_one_wake_too() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    link = FakeLink(holder)
    link.delay = 0.05
    hold, _ = _hold(holder, link, hold_s=0)
    results = await asyncio.gather(
        *(hold.hold(TENANT, MODEL, _targets(holder)) for _ in range(10))
    )
    assert all(_error(r)["code"] == "model_waking" for r in results)
    assert len(link.calls) == 1


@pytest.mark.parametrize(
    ("branch", "message"),
    [
        ("node_offline", "wake requested: node gpu-7 is offline (no heartbeat since ...)"),
        ("card_borrowed", "wake requested: card(s) [0] of node gpu-7 are borrowed by training"),
        ("container_gone", "task t-1: its container was gone at wake"),
    ],
)
@pytest.mark.feature("F6")
async def test_a_wake_that_cannot_happen_is_503_with_its_message_never_a_hang(
    branch: str, message: str
) -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    hold, metrics = _hold(holder, FakeLink(holder, branch, message), hold_s=60)
    result = await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 1)
    err = _error(result)
    assert err["code"] == "model_unavailable"
    assert message in str(err["message"])
    assert metrics.holds == {(MODEL, "refused"): 1}
    assert metrics.wakes == {(MODEL, branch): 1}


async def test_the_same_with_holding_off() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    hold, _ = _hold(holder, FakeLink(holder, "node_offline", "node gpu-7 is offline"), hold_s=0)
    err = _error(await hold.hold(TENANT, MODEL, _targets(holder)))
    assert err["code"] == "model_unavailable" and "gpu-7 is offline" in str(err["message"])


async def test_a_server_that_cannot_be_asked_is_503() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    link = FakeLink(holder)
    link.fail = True
    hold, metrics = _hold(holder, link)
    err = _error(await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 1))
    assert err["code"] == "wake_failed"
    assert metrics.wakes == {(MODEL, "error"): 1}


async def test_a_wake_that_fails_after_it_started_ends_the_hold_at_once() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    hold, metrics = _hold(holder, FakeLink(holder), hold_s=60)
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder)))
    await asyncio.sleep(0.03)
    holder.publish(_snap(2))  # neither asleep nor running: the wake failed
    err = _error(await asyncio.wait_for(task, 1))
    assert err["code"] == "no_healthy_backend"
    assert metrics.holds == {(MODEL, "failed"): 1}


async def test_already_waking_groups_are_waited_for_not_woken_again() -> None:
    holder = SnapshotHolder(_snap(1, asleep="waking"))
    link = FakeLink(holder)
    hold, _ = _hold(holder, link)
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder)))
    await asyncio.sleep(0.03)
    holder.publish(_snap(2, backends=1))
    assert isinstance(await asyncio.wait_for(task, 1), Ready)
    assert link.calls == []


async def test_a_client_that_leaves_stops_waiting() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    hold, metrics = _hold(holder, FakeLink(holder))
    left = asyncio.Event()
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder), left.wait))
    await asyncio.sleep(0.03)
    left.set()
    assert await asyncio.wait_for(task, 1) is CLIENT_LEFT
    assert metrics.held == {MODEL: 0} and metrics.holds == {(MODEL, "client_left"): 1}
    await asyncio.sleep(0.05)
    assert hold.holds_in_progress == 0


async def test_a_gateway_without_a_server_says_it_cannot_wake() -> None:
    holder = SnapshotHolder(_snap(1, asleep="sleeping"))
    hold, _ = _hold(holder, None)
    err = _error(await hold.hold(TENANT, MODEL, _targets(holder)))
    assert err["code"] == "model_unavailable"


def test_outcome_and_branch_labels_stay_bounded() -> None:
    m = GatewayMetrics()
    m.woken("chat", "something-new")
    m.hold_done("chat", "weird", None)
    assert m.wakes == {("chat", "other"): 1}
    assert m.holds == {("chat", "other"): 1}


# --- M17: a model whose replicas are starting -------------------------------------------


@pytest.mark.feature("M17")
def test_the_reason_to_hold() -> None:
    def reason(snap: RoutingSnapshot) -> str | None:
        return hold_reason(snap.routes[TENANT, MODEL])

    assert reason(_snap(1, starting=1)) == "starting"
    assert reason(_snap(1, asleep="sleeping", starting=1)) == "asleep"  # the wake first
    # a replica leaving a rolling update takes no new request: the new one is waited for
    assert reason(_snap(1, backends=1, draining=True, starting=1)) == "starting"
    # routable: route it, even while more replicas start
    assert reason(_snap(1, backends=1, starting=2)) is None
    # replicas that all failed (none starting, none asleep): 503 at once, as before
    assert reason(_snap(1)) is None
    assert hold_reason(None) is None and hold_reason(()) is None


@pytest.mark.feature("M17")
def test_how_long_replicas_have_been_starting_is_the_longest_wait() -> None:
    t = (
        RouteTarget("r-1", "tg-1", 0, 1, (), starting=2, starting_since=NOW - 95),
        RouteTarget("r-2", "tg-2", 1, 1, (), starting=1, starting_since=NOW - 3),
        RouteTarget("r-3", "tg-3", 2, 1, ()),
    )
    assert starting_for(t, NOW) == (3, 95.0)
    assert starting_for((), NOW) == (0, 0.0)
    # an older server's snapshot says nothing of since when: unknown, never negative
    assert starting_for((RouteTarget("r", "g", 0, 1, (), starting=1),), NOW) == (1, 0.0)
    assert starting_for(t, NOW - 500) == (3, 0.0)


@pytest.mark.feature("M17")
async def test_a_request_for_a_starting_model_is_held_until_a_replica_is_up() -> None:
    holder = SnapshotHolder(_snap(1, starting=1, starting_since=NOW - 2))
    link = FakeLink(holder)
    hold, metrics = _hold(holder, link)
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder)))
    await asyncio.sleep(0.05)
    assert not task.done() and metrics.held == {MODEL: 1}
    up = _snap(2, backends=1)
    holder.publish(up)
    result = await asyncio.wait_for(task, 1)
    assert isinstance(result, Ready) and result.snapshot is up
    assert link.calls == []  # nothing sleeps: no wake is asked for
    assert link.refreshes > 0  # it asked for fresh snapshots while holding
    assert metrics.start_holds == {(MODEL, "ready"): 1} and metrics.holds == {}
    assert metrics.held == {MODEL: 0} and hold.holds_in_progress == 0
    text = metrics.render().decode()
    assert 'heteroflow_gateway_start_holds_total{model="chat",outcome="ready"} 1' in text
    assert 'heteroflow_gateway_start_hold_seconds_count{model="chat"} 1' in text


@pytest.mark.feature("M17")
async def test_a_start_hold_that_ends_unready_says_how_many_start_and_for_how_long() -> None:
    holder = SnapshotHolder(_snap(1, starting=2, starting_since=NOW - 95))
    hold, metrics = _hold(holder, FakeLink(holder), start_hold_s=0.1)
    err = _error(await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 2))
    assert err["code"] == "model_starting"
    assert err["message"] == (
        "The model `chat` has 2 replicas starting (for 95 s) and none was ready within "
        "0.1 s. Please retry in 7 s."
    )
    assert metrics.start_holds == {(MODEL, "timeout"): 1}
    await asyncio.sleep(0.05)
    assert hold.holds_in_progress == 0


@pytest.mark.feature("M17")
async def test_start_holding_off_answers_503_at_once() -> None:
    holder = SnapshotHolder(_snap(1, starting=1, starting_since=NOW - 3))
    link = FakeLink(holder)
    hold, metrics = _hold(holder, link, start_hold_s=0)
    err = _error(await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 1))
    assert err["message"] == (
        "The model `chat` has 1 replica starting (for 3 s). Please retry in 7 s."
    )
    assert metrics.start_holds == {(MODEL, "not_held"): 1}
    assert hold.holds_in_progress == 0 and link.calls == [] and link.refreshes == 0


@pytest.mark.feature("M17")
async def test_replicas_that_fail_while_held_end_the_hold_at_once() -> None:
    holder = SnapshotHolder(_snap(1, starting=1))
    hold, metrics = _hold(holder, FakeLink(holder), start_hold_s=60)
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder)))
    await asyncio.sleep(0.03)
    holder.publish(_snap(2))  # none starting, none running: the replica failed
    err = _error(await asyncio.wait_for(task, 1))
    assert err["code"] == "no_healthy_backend"
    assert metrics.start_holds == {(MODEL, "failed"): 1}


async def test_a_model_with_nothing_on_its_way_is_not_held() -> None:
    holder = SnapshotHolder(_snap(1))
    hold, metrics = _hold(holder, FakeLink(holder), start_hold_s=60)
    err = _error(await asyncio.wait_for(hold.hold(TENANT, MODEL, _targets(holder)), 1))
    assert err["code"] == "no_healthy_backend"
    assert hold.holds_in_progress == 0 and metrics.held == {}


async def _polls_until_refreshed(link: FakeLink, times: int = 3) -> float:
    """Waits until the link was asked ``times`` times; how many polls of 0.01 s that
    took (the machine may be busy: the bound follows the time it really took)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while link.refreshes < times:
        assert loop.time() - start < 5, link.refreshes
        await asyncio.sleep(0.005)
    return (loop.time() - start) / 0.01


@pytest.mark.feature("M17")
async def test_a_thousand_held_requests_share_one_poll() -> None:
    holder = SnapshotHolder(_snap(1, starting=1))
    link = FakeLink(holder)
    hold, metrics = _hold(holder, link)
    tasks = [
        asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder))) for _ in range(1000)
    ]
    polls = await _polls_until_refreshed(link)
    assert metrics.held == {MODEL: 1000} and hold.holds_in_progress == 1
    assert link.refreshes <= polls + 2  # one poller, not one per request
    holder.publish(_snap(2, backends=1))
    results = await asyncio.wait_for(asyncio.gather(*tasks), 2)
    assert all(isinstance(r, Ready) for r in results)
    assert metrics.start_holds == {(MODEL, "ready"): 1000}


async def test_many_models_held_at_once_share_the_refreshes() -> None:
    routes: dict[tuple[str, str], tuple[RouteTarget, ...]] = {
        (TENANT, f"m{i}"): (RouteTarget(f"r{i}", f"g{i}", 0, 1, (), starting=1),)
        for i in range(50)
    }
    holder = SnapshotHolder(RoutingSnapshot(version=1, routes=routes))
    link = FakeLink(holder)
    hold, _ = _hold(holder, link)
    tasks = [
        asyncio.create_task(hold.hold(TENANT, m, ts)) for (_, m), ts in routes.items()
    ]
    polls = await _polls_until_refreshed(link)
    assert hold.holds_in_progress == 50
    assert link.refreshes <= polls + 2  # not fifty per poll
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await hold.aclose()


@pytest.mark.feature("M17")
async def test_a_gateway_without_a_server_still_waits_for_starting_replicas() -> None:
    # a separate gateway with no server link: its own poller brings the new snapshot
    holder = SnapshotHolder(_snap(1, starting=1))
    hold, _ = _hold(holder, None)
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder)))
    await asyncio.sleep(0.03)
    assert not task.done()
    holder.publish(_snap(2, backends=1))
    assert isinstance(await asyncio.wait_for(task, 1), Ready)


async def test_a_client_that_leaves_a_start_hold_stops_waiting() -> None:
    holder = SnapshotHolder(_snap(1, starting=1))
    hold, metrics = _hold(holder, FakeLink(holder))
    left = asyncio.Event()
    task = asyncio.create_task(hold.hold(TENANT, MODEL, _targets(holder), left.wait))
    await asyncio.sleep(0.03)
    left.set()
    assert await asyncio.wait_for(task, 1) is CLIENT_LEFT
    assert metrics.start_holds == {(MODEL, "client_left"): 1}
    await asyncio.sleep(0.05)
    assert hold.holds_in_progress == 0


@pytest.mark.feature("M17")
def test_starting_replicas_cross_the_wire_to_a_separate_gateway() -> None:
    snap = _snap(3, starting=2, starting_since=NOW - 40)
    back = RoutingSnapshot.from_wire(orjson.loads(orjson.dumps(snap.to_wire())))
    (t,) = back.routes[TENANT, MODEL]
    assert (t.starting, t.starting_since) == (2, NOW - 40)
    # nothing starting: nothing on the wire (older gateways, and the publisher's
    # fingerprint, see the same targets as before)
    (quiet,) = _snap(4).to_wire()["routes"][0]["targets"]
    assert "starting" not in quiet and "starting_since" not in quiet
