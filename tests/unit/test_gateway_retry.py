"""Failover of a request whose backend connection failed: the bound on attempts and the
choice of the next backend (gateway.retry with the Balancer). Pure: no sockets. Which
failures prove that nothing was sent is the wire client's, proven on real sockets in
tests/integration/test_http_wire.py."""

from __future__ import annotations

from heteroflow.gateway.balancing import Balancer
from heteroflow.gateway.health import PassiveHealth
from heteroflow.gateway.retry import may_fail_over, without
from heteroflow.schemas.routing import Backend, RouteTarget


def test_at_most_max_retries_further_attempts_and_only_when_nothing_was_sent() -> None:
    assert may_fail_over(nothing_sent=True, retries_done=0, max_retries=1)
    assert not may_fail_over(nothing_sent=True, retries_done=1, max_retries=1)
    assert not may_fail_over(nothing_sent=False, retries_done=0, max_retries=1)
    assert not may_fail_over(nothing_sent=True, retries_done=0, max_retries=0)  # turned off
    assert may_fail_over(nothing_sent=True, retries_done=1, max_retries=2)


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
