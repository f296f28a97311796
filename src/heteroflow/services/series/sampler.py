"""One sample of every live series from what the server already holds (issue 33).

* **Services** (task groups with a running replica or a gateway's report): from the
  gateways' fresh load reports (``services.tenancy.usage.fresh_reports``) — requests and
  errors per second are the growth of each gateway's counters since the previous sample
  (the counters are per gateway and backend, since the gateway started: a restarted
  gateway has a new id, so nothing is counted twice or negative); latency and TTFT are the
  gateways' percentiles over their last 30 s (p50: the mean of the backends' p50 weighted
  by their requests; p95: the highest backend's p95 — an upper bound, percentiles do not
  add); in flight and tokens/s are summed; the queue is each engine's own (the highest
  a gateway scraped, summed over the replicas); the prefix-cache hit rate is the growth
  of the engines' hit and query counters (vLLM only: other engines export none).
  Requests a gateway refused before choosing a backend (no healthy backend, a hold that
  timed out) are counted on their service, as requests and errors of their kind.
  Replicas: the group's current replicas running, from the tasks table.
* **Nodes**: CPU and memory of the host, from the last heartbeat (nodes seen within
  ``offline_after_s``).
* **Cards** (key ``<node id>/<index>``): the memory the card reports used and its total,
  its temperature where reported, and ``committed_pct``: what the tasks placed on it
  booked (``core.quotas.per_card_pct``, the scheduler's own figure). Utilisation: no
  agent reports it today, so it is absent (the console shows "n/a").

Rates need two samples: the first one after a start (or a change of leader) has none.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from heteroflow.core.quotas import per_card_pct
from heteroflow.core.series import ERROR_METRIC
from heteroflow.core.states import HOLDS_RESOURCES, TaskStatus
from heteroflow.db.tables import Node, Task, TaskGroup
from heteroflow.services.tenancy.usage import fresh_reports

Values = dict[str, float | None]


@dataclass(frozen=True, slots=True)
class _Counters:
    at: datetime
    answered: float
    errors: Mapping[str, float]


@dataclass
class Sampler:
    """Keeps the previous sample's counters (in memory: the leader's)."""

    load_stale_s: float
    offline_after_s: float
    _prev: dict[tuple[str, str], _Counters] = field(default_factory=dict)
    _prefix_prev: dict[str, tuple[float, float]] = field(default_factory=dict)

    def sample(self, s: Session, now: datetime) -> dict[tuple[str, str], Values]:
        out: dict[tuple[str, str], Values] = {}
        out.update(self._services(s, now))
        out.update(_nodes_and_cards(s, now, self.offline_after_s))
        return out

    def _services(self, s: Session, now: datetime) -> dict[tuple[str, str], Values]:
        reports = fresh_reports(s, now, self.load_stale_s)
        per_group: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
        for gateway, _, backends, refused in reports:
            for b in backends:
                if isinstance(b, dict) and isinstance(b.get("group_id"), str):
                    per_group[b["group_id"]].append((gateway, b))
            for group_id, errs in refused.items():
                if isinstance(errs, dict):  # counted like a backend with errors only
                    per_group[group_id].append((gateway, _refused_entry(group_id, errs)))
        replicas = _replicas(s)
        live = set(per_group) | {g for g, n in replicas.items() if n > 0}
        seen: dict[tuple[str, str], _Counters] = {}
        out: dict[tuple[str, str], Values] = {}
        for group_id in live:
            values = self._group(now, per_group.get(group_id, []), seen)
            values["replicas"] = float(replicas.get(group_id, 0))
            out[("service", group_id)] = values
        self._prev = seen
        return out

    def _group(
        self,
        now: datetime,
        backends: Iterable[tuple[str, dict[str, Any]]],
        seen: dict[tuple[str, str], _Counters],
    ) -> Values:
        in_flight = tokens = 0.0
        requests: float | None = None
        errors: dict[str, float] = {}
        queue: dict[str, float] = {}  # task -> its engine's queue (the highest scrape)
        prefix: dict[str, tuple[float, float]] = {}  # task -> (hits, queries), highest
        lat: list[tuple[float, list[float]]] = []
        ttft: list[tuple[float, list[float]]] = []
        for gateway, b in backends:
            task = str(b.get("task_id", ""))
            in_flight += _num(b.get("in_flight")) or 0.0
            tokens += _num(b.get("tokens_per_s")) or 0.0
            waiting = _num(b.get("waiting"))
            if waiting is not None:
                queue[task] = max(queue.get(task, 0.0), waiting)
            pre = b.get("prefix")
            if isinstance(pre, list) and len(pre) == 2 and all(_num(x) is not None for x in pre):
                old = prefix.get(task, (0.0, 0.0))
                prefix[task] = (max(old[0], float(pre[0])), max(old[1], float(pre[1])))
            answered = _num(b.get("answered"))
            if answered is None:
                continue
            raw_errs = b.get("errors")
            errs: dict[str, Any] = raw_errs if isinstance(raw_errs, dict) else {}
            now_counters = _Counters(
                now, answered, {k: v for k, v in errs.items() if _num(v) is not None}
            )
            seen[(gateway, task)] = now_counters
            prev = self._prev.get((gateway, task))
            weight = 1.0
            if prev is not None and now > prev.at and answered >= prev.answered:
                dt = (now - prev.at).total_seconds()
                requests = (requests or 0.0) + (answered - prev.answered) / dt
                weight = max(answered - prev.answered, 0.0)
                for kind, v in now_counters.errors.items():
                    grew = max(float(v) - float(prev.errors.get(kind, 0.0)), 0.0)
                    errors[kind] = errors.get(kind, 0.0) + grew / dt
            for name, into in (("latency_ms", lat), ("ttft_ms", ttft)):
                pair = b.get(name)
                if isinstance(pair, list) and len(pair) == 2:
                    into.append((weight, [float(pair[0]), float(pair[1])]))
        values: Values = {
            "in_flight": in_flight,
            "tokens_per_s": tokens,
            "requests_per_s": requests,
            "queue": sum(queue.values()) if queue else None,
            "prefix_hit_rate": self._hit_rate(prefix),
        }
        if requests is not None:
            values["errors_per_s"] = sum(errors.values())
            for kind, metric in ERROR_METRIC.items():
                values[metric] = errors.get(kind, 0.0)
        values["latency_p50_ms"], values["latency_p95_ms"] = _combine(lat)
        values["ttft_p50_ms"], values["ttft_p95_ms"] = _combine(ttft)
        return values

    def _hit_rate(self, prefix: dict[str, tuple[float, float]]) -> float | None:
        hits = queries = 0.0
        for task, (h, q) in prefix.items():
            old = self._prefix_prev.get(task)
            self._prefix_prev[task] = (h, q)
            if old is not None and q >= old[1] and h >= old[0]:
                hits += h - old[0]
                queries += q - old[1]
        return hits / queries if queries > 0 else None


def _refused_entry(group_id: str, errs: Mapping[str, Any]) -> dict[str, Any]:
    """A service's refusals (before a backend was chosen) as a backend entry with no load:
    every request counted is an error of its kind."""
    counts = {k: v for k, v in errs.items() if _num(v) is not None}
    return {
        "task_id": "@refused:" + group_id,
        "group_id": group_id,
        "answered": sum(float(v) for v in counts.values()),
        "errors": counts,
    }


def _combine(found: list[tuple[float, list[float]]]) -> tuple[float | None, float | None]:
    if not found:
        return None, None
    total = sum(w for w, _ in found)
    if total <= 0:
        p50 = sum(p[0] for _, p in found) / len(found)
    else:
        p50 = sum(w * p[0] for w, p in found) / total
    return p50, max(p[1] for _, p in found)


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _replicas(s: Session) -> dict[str, int]:
    """Running current replicas per live group."""
    out: dict[str, int] = defaultdict(int)
    rows = s.execute(
        select(Task.group_id)
        .join(TaskGroup, TaskGroup.id == Task.group_id)
        .where(
            TaskGroup.deleted_at.is_(None),
            Task.status == TaskStatus.RUNNING.value,
            Task.replaced_by == "",
        )
    )
    for (group_id,) in rows:
        out[group_id] += 1
    return out


def _nodes_and_cards(
    s: Session, now: datetime, offline_after_s: float
) -> dict[tuple[str, str], Values]:
    out: dict[tuple[str, str], Values] = {}
    committed: dict[tuple[str, int], float] = defaultdict(float)
    for node_id, gpu_ids, required, task_type, util in s.execute(
        select(
            Task.node_id, Task.gpu_ids, Task.gpu_required, Task.task_type,
            Task.gpu_memory_utilization,
        ).where(Task.status.in_([t.value for t in HOLDS_RESOURCES]), Task.node_id.is_not(None))
    ):
        pct = per_card_pct(required, task_type, util)
        for i in gpu_ids or ():
            if isinstance(i, int) or (isinstance(i, str) and i.isdigit()):
                committed[(str(node_id), int(i))] += pct
    cutoff = now - timedelta(seconds=offline_after_s)
    # the four columns, not the whole row: a node's models, ports and labels are most
    # of its bytes, and a round at 2,000 nodes parsed them all for nothing
    nodes = select(Node.id, Node.cpu_percent, Node.memory_percent, Node.gpus).where(
        Node.last_heartbeat_at >= cutoff
    )
    for node_id, cpu_percent, memory_percent, gpus in s.execute(nodes):
        out[("node", node_id)] = {"cpu_percent": cpu_percent, "memory_percent": memory_percent}
        for card in gpus or ():
            if not isinstance(card, dict) or not isinstance(card.get("index"), int):
                continue
            index = card["index"]
            out[("card", f"{node_id}/{index}")] = {
                "memory_used_mb": _num(card.get("memory_used_mb")),
                "memory_total_mb": _num(card.get("memory_total_mb")),
                "temperature_c": _num(card.get("temperature_c")),
                "utilisation_pct": _num(card.get("utilization_pct")),
                "committed_pct": committed.get((node_id, index), 0.0),
            }
    return out
