"""The server's Prometheus metrics (P3): API, controllers, scheduler, leader, fleet.

Served on the server's port at ``GET /metrics`` after the in-process gateway's series
(``api/app.py``'s dispatcher asks ``server.py`` for both). Counting is a dict update under
one lock (the API counts on the event loop, the controllers in worker threads); the text
is built only when scraped. Labels stay bounded: the API's ``route`` is the route's
template (``/api/v1/task-groups/{group_id}``, never an id; ``other`` when no route
matched), ``method`` one of the HTTP methods (else ``other``), ``code`` a status class.

Series (all ``heteroflow_server_``):
  api_request_duration_seconds{method,route,code}   histogram, request in to last byte out
  controller_rounds_total{controller}                counter: rounds run (a leader-only
                                                       loop on a follower runs none)
  controller_round_duration_seconds{controller}      histogram (the scheduler's = its round)
  controller_errors_total{controller,kind}           counter, kind exception | lease_lost
  scheduler_placed_total / _preempted_total /
    _conflicts_total                                 counters, from every scheduling round
  scheduler_decision_seconds                          histogram: per placed task, commit
                                                       included
  scheduler_waiting_tasks                             gauge: left pending by the latest round
  leader{instance}                                    gauge: 1 on the lease holder, else 0
  leader_epoch{instance}                              gauge: the lease's epoch while held
  nodes{status}                                       gauge, online | offline
  tasks{status}                                       gauge, every task status
The fleet gauges (nodes, tasks) come from two aggregate queries run at most every
``refresh_s`` (``metrics_fleet_refresh_s``), not per scrape: scrapes from several
Prometheus servers cost the database nothing more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import case, func, select

from heteroflow.core.clock import Clock
from heteroflow.core.prometheus import Exposition, Histogram
from heteroflow.core.states import TaskStatus
from heteroflow.db.engine import Database
from heteroflow.db.tables import Node, Task
from heteroflow.services.placement.scheduling import RoundResult

log = logging.getLogger(__name__)
P = "heteroflow_server_"
API_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ROUND_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
OTHER = "other"
# (epoch or None, this instance's id): who leads, as the elector knows it now
LeaderState = tuple[int | None, str]


@dataclass(frozen=True, slots=True)
class FleetCounts:
    nodes: dict[str, int] = field(default_factory=dict)  # online | offline
    tasks: dict[str, int] = field(default_factory=dict)  # every TaskStatus, 0 when none


def read_fleet_counts(db: Database, clock: Clock, offline_after_s: float) -> FleetCounts:
    """Nodes online/offline (no heartbeat for ``offline_after_s``) and tasks by status:
    two aggregate queries (``tasks`` by its status index)."""
    cutoff = clock.now() - timedelta(seconds=offline_after_s)
    with db.session() as s:
        online, total = s.execute(
            select(
                func.coalesce(func.sum(case((Node.last_heartbeat_at >= cutoff, 1), else_=0)), 0),
                func.count(),
            ).select_from(Node)
        ).one()
        rows = s.execute(select(Task.status, func.count()).group_by(Task.status))
        by_status: dict[str, int] = {status: int(n) for status, n in rows}
    tasks = {st.value: by_status.pop(st.value, 0) for st in TaskStatus}
    tasks.update(by_status)  # a status added later still shows
    return FleetCounts({"online": int(online), "offline": int(total) - int(online)}, tasks)


def status_class(status: int) -> str:
    return f"{status // 100}xx" if 100 <= status < 600 else OTHER


class ServerMetrics:
    """One per server process; ``render`` is called off the event loop (it may query)."""

    def __init__(
        self,
        *,
        fleet: Callable[[], FleetCounts] | None = None,
        leader: Callable[[], LeaderState] | None = None,
        refresh_s: float = 5.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self._fleet_source = fleet
        self._leader = leader
        self._refresh_s = refresh_s
        self._monotonic = monotonic
        self._fleet: FleetCounts | None = None
        self._fleet_at = 0.0
        self.api: dict[tuple[str, str, str], Histogram] = {}
        self.rounds: dict[str, int] = {}
        self.round_seconds: dict[str, Histogram] = {}
        self.errors: dict[tuple[str, str], int] = {}
        self.placed = self.preempted = self.conflicts = 0
        self.decisions = Histogram(DECISION_BUCKETS)
        self.waiting: int | None = None

    # -- counting ----------------------------------------------------------------------
    def api_request(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method if method in METHODS else OTHER, route, status_class(status))
        with self._lock:
            h = self.api.get(key)
            if h is None:
                h = self.api[key] = Histogram(API_BUCKETS)
            h.observe(seconds)

    def controller_round(self, name: str, seconds: float, error: str | None = None) -> None:
        """One round of ``name`` ran for ``seconds``; ``error``: exception | lease_lost."""
        with self._lock:
            self.rounds[name] = self.rounds.get(name, 0) + 1
            h = self.round_seconds.get(name)
            if h is None:
                h = self.round_seconds[name] = Histogram(ROUND_BUCKETS)
            h.observe(seconds)
            if error is not None:
                self.errors[(name, error)] = self.errors.get((name, error), 0) + 1

    def scheduler_round(self, result: RoundResult) -> None:
        with self._lock:
            self.placed += result.placed
            self.preempted += result.preempted
            self.conflicts += result.conflicts
            for ms in result.decision_ms:
                self.decisions.observe(ms / 1000.0)
            self.waiting = result.unplaced

    # -- exposition --------------------------------------------------------------------
    def fleet(self) -> FleetCounts | None:
        """The fleet counts, read again when older than ``refresh_s``."""
        if self._fleet_source is None:
            return None
        now = self._monotonic()
        if self._fleet is None or now - self._fleet_at >= self._refresh_s:
            try:
                self._fleet = self._fleet_source()
            except Exception as exc:  # the database away: the last counts (or none) stand
                log.warning("metrics: fleet counts not read: %s", type(exc).__name__)
            self._fleet_at = now  # tried: the next try waits refresh_s either way
        return self._fleet

    def state(self) -> dict[str, Any]:
        """What this process counted (copies), for the sum over a server's processes."""
        leader = self._leader() if self._leader is not None else None
        with self._lock:
            return {
                "api": {k: h.copy() for k, h in self.api.items()},
                "rounds": dict(self.rounds),
                "round_seconds": {k: h.copy() for k, h in self.round_seconds.items()},
                "errors": dict(self.errors),
                "placed": self.placed,
                "preempted": self.preempted,
                "conflicts": self.conflicts,
                "decisions": self.decisions.copy(),
                "waiting": self.waiting,
                "leaders": [] if leader is None else [leader],
            }

    def render(self, others: Sequence[tuple[Mapping[str, Any], bool]] = ()) -> bytes:
        """This process's series — summed, with ``others`` (the states of the other
        processes of ``server --workers N``, each with whether it lives), with theirs:
        counters and histograms of every process, gauges (the scheduler's waiting tasks,
        the leader lease) of the live ones. The fleet gauges are read here."""
        fleet = self.fleet()
        total = self.state()
        for state, alive in others:
            _add_state(total, state, gauges=alive)
        api, rounds, errors = total["api"], total["rounds"], total["errors"]
        round_seconds = total["round_seconds"]
        placed, preempted, conflicts = total["placed"], total["preempted"], total["conflicts"]
        decisions, waiting = total["decisions"], total["waiting"]
        e = Exposition()
        e.family(
            f"{P}api_request_duration_seconds",
            "histogram",
            "Management API requests: time from the request to the last byte of the answer.",
        )
        for (method, route, code), h in sorted(api.items()):
            labels = {"method": method, "route": route, "code": code}
            e.histogram(f"{P}api_request_duration_seconds", h, labels)
        e.family(f"{P}controller_rounds_total", "counter", "Controller rounds run here.")
        for name, n in sorted(rounds.items()):
            e.sample(f"{P}controller_rounds_total", n, {"controller": name})
        e.family(
            f"{P}controller_round_duration_seconds", "histogram", "Time one controller round took."
        )
        for name, h in sorted(round_seconds.items()):
            e.histogram(f"{P}controller_round_duration_seconds", h, {"controller": name})
        e.family(
            f"{P}controller_errors_total",
            "counter",
            "Controller rounds that failed (exception) or were refused their lease (lease_lost).",
        )
        for (name, kind), n in sorted(errors.items()):
            e.sample(f"{P}controller_errors_total", n, {"controller": name, "kind": kind})
        for name, n, text in (
            ("placed", placed, "Tasks placed on a node by this instance's scheduler."),
            ("preempted", preempted, "Tasks stopped to make room for a higher priority."),
            ("conflicts", conflicts, "Placements dropped: another scheduler booked first."),
        ):
            e.family(f"{P}scheduler_{name}_total", "counter", text)
            e.sample(f"{P}scheduler_{name}_total", n)
        e.family(
            f"{P}scheduler_decision_seconds",
            "histogram",
            "Time to place one task, its commit included.",
        )
        e.histogram(f"{P}scheduler_decision_seconds", decisions)
        e.family(f"{P}scheduler_waiting_tasks", "gauge", "Tasks left waiting by the latest round.")
        if waiting is not None:
            e.sample(f"{P}scheduler_waiting_tasks", waiting)
        leaders = sorted(total["leaders"], key=lambda held: str(held[1]))
        if leaders:
            e.family(f"{P}leader", "gauge", "1 on the instance holding the controllers lease.")
            for epoch, instance in leaders:
                e.sample(f"{P}leader", 0 if epoch is None else 1, {"instance": instance})
            e.family(f"{P}leader_epoch", "gauge", "The lease's epoch, on the instance holding it.")
            for epoch, instance in leaders:
                if epoch is not None:
                    e.sample(f"{P}leader_epoch", epoch, {"instance": instance})
        if fleet is not None:
            e.family(f"{P}nodes", "gauge", "Nodes by status (offline: no recent heartbeat).")
            for status, n in fleet.nodes.items():
                e.sample(f"{P}nodes", n, {"status": status})
            e.family(f"{P}tasks", "gauge", "Tasks by status.")
            for status, n in fleet.tasks.items():
                e.sample(f"{P}tasks", n, {"status": status})
        return e.render()


def _add_state(total: dict[str, Any], state: Mapping[str, Any], *, gauges: bool) -> None:
    """Add another process's ``ServerMetrics.state`` into ``total`` (counters and
    histograms always; gauges only when ``gauges``: the process lives)."""
    for name in ("api", "round_seconds"):
        hists: dict[Any, Histogram] = total[name]
        for key, h in state.get(name, {}).items():
            mine = hists.get(key)
            if mine is None:
                hists[key] = h.copy()
            else:
                mine.add(h)
    for name in ("rounds", "errors"):
        counts: dict[Any, int] = total[name]
        for key, n in state.get(name, {}).items():
            counts[key] = counts.get(key, 0) + n
    for name in ("placed", "preempted", "conflicts"):
        total[name] += state.get(name, 0)
    if "decisions" in state:
        total["decisions"].add(state["decisions"])
    if gauges:
        if state.get("waiting") is not None:  # the process that ran the scheduler
            total["waiting"] = (total["waiting"] or 0) + state["waiting"]
        total["leaders"].extend(state.get("leaders", ()))

