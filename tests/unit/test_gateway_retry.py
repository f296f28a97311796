"""Failover of a request whose backend provably did not answer: the budgets and the
deadline (``gateway.retry.Failovers``) and the choice of the next backend (with the
Balancer). Pure: no sockets. Which failures prove that nothing was sent, or that nothing
was answered, is the wire client's, proven on real sockets in
tests/integration/test_http_wire.py."""

from __future__ import annotations

from heteroflow.gateway.backend.retry import Failovers, without
from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.schemas.routing import Backend, RouteTarget

DEADLINE = 100.0


def _allow(f: Failovers, url: str, *, sent: bool, answered: bool = False, now: float = 0.0) -> bool:
    return f.allow(url, nothing_sent=not sent, unanswered=sent and not answered, now=now)


def test_at_most_connect_retries_further_attempts_when_nothing_was_sent() -> None:
    f = Failovers(1, True, DEADLINE)
    assert _allow(f, "a", sent=False)
    assert not _allow(f, "b", sent=False)
    assert f.tried == ["a", "b"]
    assert not _allow(Failovers(0, True, DEADLINE), "a", sent=False)  # turned off
    two = Failovers(2, False, DEADLINE)
    assert _allow(two, "a", sent=False) and _allow(two, "b", sent=False)
    assert not _allow(two, "c", sent=False)


def test_a_request_sent_but_unanswered_goes_on_once_whatever_the_connect_budget() -> None:
    f = Failovers(0, True, DEADLINE)
    assert _allow(f, "a", sent=True)
    assert not _allow(f, "b", sent=True)  # once per request
    mixed = Failovers(1, True, DEADLINE)
    assert _allow(mixed, "a", sent=False)  # refused: the connect budget
    assert _allow(mixed, "b", sent=True)  # died holding it: its own budget
    assert not _allow(mixed, "c", sent=False) and mixed.tried == ["a", "b", "c"]
    assert not _allow(Failovers(1, False, DEADLINE), "a", sent=True)  # turned off


def test_an_answer_begun_or_a_silence_is_never_sent_elsewhere() -> None:
    # A partial answer (or a read timeout, which is neither nothing_sent nor unanswered)
    assert not _allow(Failovers(3, True, DEADLINE), "a", sent=True, answered=True)


def test_nothing_goes_on_once_the_request_deadline_passed() -> None:
    assert _allow(Failovers(1, True, DEADLINE), "a", sent=True, now=DEADLINE - 0.001)
    assert not _allow(Failovers(1, True, DEADLINE), "a", sent=True, now=DEADLINE)
    assert not _allow(Failovers(1, True, DEADLINE), "a", sent=False, now=DEADLINE + 1)


def _b(name: str, **kw: object) -> Backend:
    return Backend(task_id=f"task-{name}", base_url=f"http://{name}:8000", **kw)  # type: ignore[arg-type]


def _t(rid: str, *backends: Backend, priority: int = 0, weight: int = 1) -> RouteTarget:
    return RouteTarget(rid, f"g-{rid}", priority, weight, backends)


def test_without_drops_the_tried_backends_from_every_target() -> None:
    a, b, c = _b("a"), _b("b"), _b("c")
    first, second, untouched = _t("r1", a, b), _t("r2", a), _t("r3", c)
    out = without((first, second, untouched), {a.base_url})
    assert [t.backends for t in out] == [(b,), (), (c,)]
    assert out[0].route_id == "r1" and out[0].priority == first.priority
    assert out[2] is untouched  # nothing to drop: the same object, no copy


def test_the_failover_goes_to_another_healthy_backend_never_the_failed_one() -> None:
    a, b = _b("a"), _b("b")
    targets = (_t("r", a, b),)
    health = PassiveHealth(5.0)
    balancer = Balancer(health)
    assert balancer.choose(targets) == a
    health.eject(a.base_url)  # what the gateway does first when the connection fails
    for _ in range(4):
        assert balancer.choose(without(targets, [a.base_url]), fail_open=False) == b


def test_the_failover_does_not_fail_open_onto_an_ejected_backend() -> None:
    a, b = _b("a"), _b("b")
    targets = (_t("r", a, b),)
    health = PassiveHealth(5.0)
    balancer = Balancer(health)
    health.eject(a.base_url)
    health.eject(b.base_url)
    assert balancer.choose(targets) is not None  # a first attempt still fails open...
    retry = balancer.choose(without(targets, [a.base_url]), fail_open=False)
    assert retry is None  # ...a failover does not


def test_the_failed_backend_is_excluded_even_when_its_ejection_has_run_out() -> None:
    a, b = _b("a"), _b("b")
    targets = (_t("r", a, b),)
    health = PassiveHealth(0.0)  # cooldown 0: the failed backend is at once "healthy" again
    balancer = Balancer(health)
    health.eject(a.base_url)
    assert {balancer.choose(without(targets, [a.base_url])) for _ in range(4)} == {b}


def test_the_failover_takes_the_next_priority_level_and_never_a_draining_backend() -> None:
    a, drained, c = _b("a"), _b("d", draining=True), _b("c")
    targets = (_t("main", a, drained), _t("spare", c, priority=1))
    balancer = Balancer(PassiveHealth())
    assert balancer.choose(without(targets, [a.base_url]), fail_open=False) == c
    assert balancer.choose(without(targets, [a.base_url, c.base_url]), fail_open=False) is None


def test_a_session_pinned_to_the_failed_backend_is_pinned_to_the_new_one() -> None:
    a, b = _b("a"), _b("b")
    targets = (_t("r", a, b),)
    health = PassiveHealth(0.0)
    balancer = Balancer(health)
    session = ("tenant", "model", "user-1")
    assert balancer.choose(targets, session) == a
    assert balancer.choose(without(targets, [a.base_url]), session, fail_open=False) == b
    assert balancer.choose(targets, session) == b  # a is healthy again: the pin stays on b
