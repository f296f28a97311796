"""``capacity`` balancing (M15): the estimate (``CapacityView``) and the decisions, on a
fake clock, against simulated replicas.

A simulated replica is a processor-sharing server: it produces ``speed`` tokens per
second shared by the requests it holds (a CPU llama.cpp, or a GPU past its batch), so a
request's time grows with the replica's load and a 3x slower replica is one whose
``speed`` is a third. Requests are answered as the gateway would tell the balancer:
``acquire`` at the choice, ``release`` and ``observe(seconds, tokens)`` at the end.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from heteroflow.core.errors import ValidationFailed
from heteroflow.gateway.routing.balancing import (
    CAPACITY,
    ENGINE_AWARE,
    LEAST_CONNECTIONS,
    PREFIX_AFFINITY,
    RANDOM,
    ROUND_ROBIN,
    Balancer,
)
from heteroflow.gateway.routing.capacity import CapacityView
from heteroflow.gateway.routing.routes_file import load_routes
from heteroflow.schemas.routing import ALGORITHMS, Backend, RouteTarget, hash_key
from heteroflow.services.identity.auth import Principal
from heteroflow.services.serving import endpoints

TOKENS = 40  # tokens per simulated answer
DT = 0.01  # simulation step (s)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class _Replica:
    backend: Backend
    speed: float  # tokens/s, shared by the requests it holds
    active: list[list[float]] = field(default_factory=list)  # [tokens left, started at]


def _target(n: int, algorithm: str = CAPACITY) -> RouteTarget:
    return RouteTarget(
        route_id="r",
        group_id="g",
        priority=0,
        weight=100,
        backends=tuple(Backend(task_id=f"t{i}", base_url=f"http://r{i}:8000") for i in range(n)),
        algorithm=algorithm,
    )


@dataclass
class _Sim:
    """Closed loop: ``clients`` each send a request as soon as their last one ended."""

    balancer: Balancer
    clock: _Clock
    replicas: list[_Replica]
    target: RouteTarget
    served: Counter[str] = field(default_factory=Counter)
    seconds: dict[str, float] = field(default_factory=dict)  # sum of latencies

    def send(self) -> None:
        b = self.balancer.choose([self.target])
        assert b is not None
        self.balancer.acquire(b)
        replica = next(r for r in self.replicas if r.backend is b)
        replica.active.append([float(TOKENS), self.clock.now])

    def run(self, seconds: float, clients: int = 0) -> None:
        for _ in range(clients):
            self.send()
        for _ in range(round(seconds / DT)):
            self.clock.now += DT
            ended = 0
            for r in self.replicas:
                if not r.active:
                    continue
                step = r.speed * DT / len(r.active)
                for req in r.active:
                    req[0] -= step
                for req in [q for q in r.active if q[0] <= 0]:
                    r.active.remove(req)
                    took = self.clock.now - req[1]
                    self.balancer.release(r.backend)
                    self.balancer.observe(r.backend, took, TOKENS)
                    self.served[r.backend.task_id] += 1
                    tid = r.backend.task_id
                    self.seconds[tid] = self.seconds.get(tid, 0.0) + took
                    ended += 1
            for _ in range(ended):
                self.send()

    def reset_counts(self) -> None:
        self.served.clear()
        self.seconds.clear()

    def mean_latency(self, task_id: str) -> float:
        return self.seconds[task_id] / self.served[task_id]


def _sim(speeds: list[float], algorithm: str = CAPACITY) -> _Sim:
    clock = _Clock()
    target = _target(len(speeds), algorithm)
    replicas = [_Replica(b, s) for b, s in zip(target.backends, speeds, strict=True)]
    return _Sim(Balancer(clock=clock), clock, replicas, target)


@pytest.mark.feature("M15")
def test_a_3x_slower_replica_gets_a_quarter_and_answers_as_fast() -> None:
    sim = _sim([300.0, 100.0])
    sim.run(20.0, clients=8)  # learn
    sim.reset_counts()
    sim.run(60.0)
    total = sim.served["t0"] + sim.served["t1"]
    assert 0.20 <= sim.served["t1"] / total <= 0.30, sim.served
    # The split is by capacity *and* the slow replica holds fewer requests, so its
    # answers take less than least_connections' 3x (equal in-flight counts). Not 1x: a
    # processor-sharing replica's seconds per token grow with what it holds, so the cost
    # (in flight + 1) x s/token is about quadratic in its load and the in-flight counts
    # split as about the square root of the capacities (sqrt 3 = 1.7).
    ratio = sim.mean_latency("t1") / sim.mean_latency("t0")
    assert ratio < 2.0, ratio

    lc = _sim([300.0, 100.0], LEAST_CONNECTIONS)
    lc.run(20.0, clients=8)
    lc.reset_counts()
    lc.run(60.0)
    assert lc.mean_latency("t1") / lc.mean_latency("t0") > 2.5  # what capacity fixes


@pytest.mark.feature("M15")
def test_equal_replicas_split_equally() -> None:
    sim = _sim([200.0, 200.0])
    sim.run(10.0, clients=6)
    sim.reset_counts()
    sim.run(40.0)
    share = sim.served["t1"] / (sim.served["t0"] + sim.served["t1"])
    assert 0.45 <= share <= 0.55, sim.served


@pytest.mark.feature("M15")
def test_a_replica_that_recovers_is_relearned() -> None:
    sim = _sim([300.0, 100.0])
    sim.run(30.0, clients=8)
    sim.replicas[1].speed = 300.0  # the slow card's throttle is lifted
    sim.run(30.0)  # a few tau_s (10 s) of answers
    sim.reset_counts()
    sim.run(30.0)
    share = sim.served["t1"] / (sim.served["t0"] + sim.served["t1"])
    assert 0.42 <= share <= 0.58, sim.served


@pytest.mark.feature("M15")
def test_a_replica_left_idle_as_slow_is_tried_again_once_its_estimate_is_stale() -> None:
    # One client at a time: the fast replica always costs less, so the slow one gets
    # nothing and learns nothing — until its estimate is older than stale_s (30 s) and
    # it counts at the route's mean again.
    sim = _sim([300.0, 100.0])
    sim.run(20.0, clients=4)
    for r in sim.replicas:  # the clients leave; one stays
        for _ in r.active:
            sim.balancer.release(r.backend)
        r.active.clear()
    sim.send()
    sim.reset_counts()
    sim.run(25.0)
    assert sim.served["t1"] == 0 and sim.served["t0"] > 100
    sim.replicas[1].speed = 600.0  # it was upgraded meanwhile
    sim.run(15.0)  # past stale_s since its last answer: tried, learned faster
    sim.reset_counts()
    sim.run(10.0)
    assert sim.served["t1"] > sim.served["t0"], sim.served


@pytest.mark.feature("M15")
def test_a_new_replica_counts_at_the_route_mean_and_is_tried_at_once() -> None:
    clock = _Clock()
    balancer = Balancer(clock=clock)
    old = _target(2)
    for b in old.backends:
        balancer.acquire(b)
        balancer.observe(b, 1.0, 100)  # 10 ms per token each
    grown = _target(3)  # a third replica joins, nothing known of it
    assert balancer.choose([grown]) is grown.backends[2]  # 1 x 10 ms < 2 x 10 ms


def test_no_estimate_is_least_connections_with_ties_in_turn() -> None:
    balancer = Balancer(clock=_Clock())
    target = _target(3)
    firsts = [balancer.choose([target]) for _ in range(3)]
    assert {b.task_id for b in firsts if b is not None} == {"t0", "t1", "t2"}
    balancer.acquire(target.backends[0])
    balancer.acquire(target.backends[1])
    assert all(balancer.choose([target]) is target.backends[2] for _ in range(3))


def test_the_cost_is_in_flight_plus_one_times_seconds_per_token() -> None:
    clock = _Clock()
    balancer = Balancer(clock=clock)
    fast, slow = _target(2).backends
    balancer.observe(fast, 1.0, 100)  # 10 ms/token
    balancer.observe(slow, 3.0, 100)  # 30 ms/token
    target = _target(2)
    picks = []
    for _ in range(4):
        b = balancer.choose([target])
        assert b is not None
        balancer.acquire(b)
        picks.append(b.task_id)
    # fast: 1x10 < 30 -> fast; 2x10 < 30 -> fast; 3x10 = 30 (tie: in turn); then 4x10 > 30
    assert picks[:2] == ["t0", "t0"] and "t1" in picks[2:]


def test_the_estimate_weighs_requests_by_their_tokens() -> None:
    clock = _Clock()
    view = CapacityView(clock)
    view.observe("u", 10.0, 1000)  # 10 ms/token
    view.observe("u", 0.5, 1)  # a one-token answer, mostly its prompt's prefill
    assert view.seconds_per_token("u", clock.now) == pytest.approx(10.5 / 1001)
    view.observe("v", 1.0, 0)  # no token: nothing learned
    view.observe("v", 0.0, 5)
    assert view.seconds_per_token("v", clock.now) == 0.0


def test_the_estimate_decays_towards_recent_answers_and_goes_stale() -> None:
    clock = _Clock()
    view = CapacityView(clock, tau_s=10.0, stale_s=30.0)
    view.observe("u", 3.0, 100)  # 30 ms/token
    clock.now += 20.0  # two tau later the old sums weigh e^-2 (13.5 %)
    view.observe("u", 1.0, 100)  # 10 ms/token
    spt = view.seconds_per_token("u", clock.now)
    assert spt == pytest.approx((3.0 * 0.1353 + 1.0) / (100 * 0.1353 + 100), rel=1e-3)
    assert spt < 0.0125
    clock.now += 30.5
    assert view.seconds_per_token("u", clock.now) == 0.0  # stale: the route's mean
    view.observe("u", 5.0, 100)  # ... and the next answer is all that is known
    assert view.seconds_per_token("u", clock.now) == pytest.approx(0.05)
    with pytest.raises(ValueError):
        CapacityView(clock, tau_s=0.0)


def test_every_balancing_algorithm_is_in_the_one_list_of_names() -> None:
    assert {ROUND_ROBIN, RANDOM, LEAST_CONNECTIONS, ENGINE_AWARE, PREFIX_AFFINITY, CAPACITY} == set(
        ALGORITHMS
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_routes_file_and_the_api_accept_every_algorithm(tmp_path: Path, algorithm: str) -> None:
    path = tmp_path / "routes.json"
    path.write_text(
        json.dumps(
            {
                "models": {"m": {"algorithm": algorithm, "backends": ["http://a:1"]}},
                "keys": {"k": {"sha256": hash_key("sk-k")}},
            }
        )
    )
    (target,) = load_routes(path, 1).routes[("default", "m")]
    assert target.algorithm == algorithm
    endpoints._check_route_fields(Principal.__new__(Principal), None, None, algorithm)
    with pytest.raises(ValidationFailed, match="capacity"):
        endpoints._check_route_fields(Principal.__new__(Principal), None, None, "fastest")
