"""What the workers of one host share (issue 31, P4): the in-flight table (each worker
writes its own column, everyone reads the sum, a dead worker's column is cleared; the
Balancer's least_connections reads it like its own dict) and /metrics (the sum)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.metrics_share import SharedMetrics
from heteroflow.gateway.routing.balancing import LEAST_CONNECTIONS, Balancer
from heteroflow.gateway.routing.inflight import LocalInFlight, SharedInFlight
from heteroflow.schemas.routing import Backend, RouteTarget

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"


def test_local_counts_drop_to_nothing() -> None:
    t = LocalInFlight()
    t.add(A, 1)
    t.add(A, 1)
    assert t.get(A, 0) == 2 and t.own(A) == 2
    t.add(A, -1)
    t.add(A, -1)
    assert A not in t and t.get(A, 0) == 0


@pytest.mark.feature("P4")
def test_a_forked_worker_counts_in_the_parents_table_and_its_column_is_cleared() -> None:
    table = SharedInFlight(4, slots=64)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker in column 1: two requests in flight to A
        try:
            child = table.for_worker(1)
            child.add(A, 1)
            child.add(A, 1)
            os.write(w, b"x")
        finally:
            os._exit(0)
    os.read(r, 1)
    os.waitpid(pid, 0)
    mine = table.for_worker(0)
    mine.add(A, 1)
    assert mine.get(A, 0) == 3  # every worker's requests
    assert mine.own(A) == 1  # this worker's alone (its load report)
    assert mine.get(B, 0) == 0
    table.clear(1)  # the worker died: what it had in flight is gone with it
    assert mine.get(A, 0) == 1
    mine.add(A, -1)
    assert mine.get(A, 0) == 0
    os.close(r)
    os.close(w)


def test_the_parent_counts_nothing_and_columns_are_checked() -> None:
    table = SharedInFlight(2, slots=8)
    with pytest.raises(RuntimeError):
        table.add(A, 1)
    assert table.own(A) == 0
    with pytest.raises(ValueError):
        table.for_worker(2)


@pytest.mark.feature("P4")
def test_two_balancers_on_one_table_balance_like_one() -> None:
    """Two workers' balancers, requests alternating between them: 3/3 over two
    backends (each on a table of its own: A, A, B, B, A, A — 4/2)."""
    table = SharedInFlight(2, slots=1024)
    target = RouteTarget(
        "r", "g", 0, 1, (Backend("a", A), Backend("b", B)), algorithm=LEAST_CONNECTIONS
    )
    # one process stands in for both workers: the column is switched between calls
    workers = [Balancer(inflight=table), Balancer(inflight=table)]
    chosen = []
    for i in range(6):
        table.for_worker(i % 2)
        b = workers[i % 2].choose([target])
        assert b is not None
        workers[i % 2].acquire(b)
        chosen.append(b.base_url)
    assert sorted(chosen) == [A, A, A, B, B, B]
    assert table.get(A, 0) == table.get(B, 0) == 3


@pytest.mark.feature("P4")
def test_metrics_are_the_sum_of_every_worker_and_a_dead_one_keeps_its_counts(
    tmp_path: Path,
) -> None:
    mine, other = GatewayMetrics(), GatewayMetrics()
    for m, n in ((mine, 2), (other, 3)):
        for _ in range(n):
            m.request_done("/v1/chat/completions", "chat", 200)
            m.upstream_latency("chat", 0.02)
        m.in_flight = n
    # another worker's file, written by a process that has exited (pid 2**22 + 1 is
    # above the usual pid_max, so nobody has it): counters stay, its gauge does not
    SharedMetrics(tmp_path, other).write()
    (tmp_path / f"{os.getpid()}.metrics").rename(tmp_path / f"{2**22 + 1}.metrics")
    text = SharedMetrics(tmp_path, mine).render().decode()
    series = 'heteroflow_gateway_requests_total{path="/v1/chat/completions",model="chat",'
    assert f'{series}status="200"}} 5' in text
    assert 'heteroflow_gateway_upstream_latency_seconds_count{model="chat"} 5' in text
    assert "heteroflow_gateway_in_flight 2" in text


@pytest.mark.feature("P4")
def test_each_process_that_takes_requests_gates_its_share_of_a_pool() -> None:
    """The fair-share gate divides a pool's bound by the processes taking requests: a
    gateway's N workers, or a server's N workers beside its controllers' process, which
    has a column of the table and takes no request (it gated bound / (N + 1))."""
    from heteroflow.gateway.app import GatewayApp
    from heteroflow.gateway.routing.fair_gate import FairShareSettings
    from heteroflow.schemas.routing import SnapshotHolder

    def share(table: SharedInFlight) -> float:
        app = GatewayApp(
            SnapshotHolder(), inflight=table, fair_share=FairShareSettings(per_backend=8)
        )
        return float(app._fair._share)

    assert SharedInFlight(4).serving == 2  # a gateway's 2 workers, old and new columns
    assert share(SharedInFlight(4)) == 0.5
    server = SharedInFlight(6, serving=2)  # 2 workers + the controllers' process
    assert server.serving == 2 and share(server) == 0.5
