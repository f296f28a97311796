"""Scheduler scale benchmark: the real scheduler against a simulated fleet in PostgreSQL.

For each fleet size (``--nodes``, default 1,000 and 10,000 nodes of mostly 8 cards) it
creates a throw-away PostgreSQL database, migrates it, bulk-inserts the nodes (simulated
kinds from ``heteroflow.testing.clusters``: mostly 8xH100 / 8xA100, every kind present),
queues ``--tasks`` mixed PENDING tasks (single card, TP-2/4/8, split replicas, shared
cards at 20-50% commitment, CPU tasks; six tenants, two of them in one sharing group;
priorities 0-1000), then calls ``Scheduler.run_round()`` until a round places nothing,
timing each round. Afterwards an independent SQL audit counts double bookings and
measures packing. The database is dropped at the end.

Figures:
- placements/s = tasks placed / total wall time of the scheduling rounds;
- decision time per task, commit included: ``RoundResult.decision_ms`` when the
  scheduler reports it, else each round's time / tasks it placed (the output says which);
- packing efficiency = lower bound / cards used, where the lower bound over the placed
  tasks is the whole cards they take (gpu_required > 1, 100% commitment or
  non-inference) plus the shared commitments / 100; 1.0 = no card wasted;
- double bookings = cards whose tasks sum to more than 100% commitment, that hold a
  whole-card task beside anything, or that mix tenants outside one sharing group.

Last line: one JSON object. ``--quick`` = 100 nodes, 1,000 tasks. Needs PostgreSQL at
``$HETEROFLOW_BENCH_PG`` (default ``postgresql://postgres@127.0.0.1:5432/postgres``).
Run: ``.venv/bin/python bench/scheduler.py`` (on one core: ``taskset -c 0 ...``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import secrets
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import BindParameter, bindparam, insert, text

from heteroflow.controllers.scheduler import Scheduler
from heteroflow.core.clock import Clock, SystemClock
from heteroflow.core.ids import new_id
from heteroflow.core.placement import Policy
from heteroflow.db.engine import Database, migrate
from heteroflow.db.tables import SharingGroup, Task, TaskGroup, Tenant
from heteroflow.testing import clusters
from heteroflow.testing.bench import fresh_database, percentile

PORT_POOL = range(20000, 40000)
OFFLINE_AFTER_S = 24 * 3600.0  # nodes are inserted once; none may age out mid-run
HELD = ("scheduled", "starting", "running", "stopping")

# Fleet mix in percent of nodes (each kind at least one node).
FLEET_MIX = (
    ("h100-sxm-8", 40),
    ("a100-mig-8", 30),
    ("mi300x-8", 8),
    ("ascend-910b-8", 7),
    ("mtt-s4000-8", 5),
    ("t4-4", 4),
    ("p100-4", 3),
    ("a10-2", 3),
)
# Workload mix in percent of tasks.
SHAPES = (("single", 25), ("tp", 5), ("split", 20), ("shared", 40), ("cpu", 10))
TP_DEGREES = ((2, 50), (4, 35), (8, 15))
PINNED_SHARE = 0.2  # GPU tasks that name a gpu_type (the card model of some kind)
TENANTS = 6  # the last two share one sharing group
REFERENCE_CARD_MB = 81559  # an H100: estimates of unpinned tasks scale from it


@dataclass
class Scale:
    nodes: int
    cards: int = 0
    queued: int = 0
    setup_db_s: float = 0.0
    setup_nodes_s: float = 0.0
    setup_tasks_s: float = 0.0
    rounds: list[tuple[int, int, float]] = field(default_factory=list)  # placed, unplaced, s
    decision_ms: list[float] = field(default_factory=list)
    decision_source: str = ""
    preempted: int = 0  # victims the scheduler asked to make room (no agent runs here)
    audit: dict[str, Any] = field(default_factory=dict)

    @property
    def placed(self) -> int:
        return sum(r[0] for r in self.rounds)

    @property
    def sched_s(self) -> float:
        return sum(r[2] for r in self.rounds)

    @property
    def placing_s(self) -> float:
        """Wall time of the rounds up to the last one that placed anything: the final
        round that finds nothing more to place is the idle check, reported apart."""
        last = max((i for i, r in enumerate(self.rounds) if r[0]), default=-1)
        return sum(r[2] for r in self.rounds[: last + 1])

    @property
    def per_s(self) -> float:
        return self.placed / self.placing_s if self.placing_s else 0.0

    @property
    def per_s_all_rounds(self) -> float:
        return self.placed / self.sched_s if self.sched_s else 0.0


def fleet_counts(nodes: int) -> dict[str, int]:
    if nodes < len(FLEET_MIX):
        raise SystemExit(f"--nodes must be at least {len(FLEET_MIX)} (one node per kind)")
    counts = {kind: max(1, nodes * pct // 100) for kind, pct in FLEET_MIX}
    while (extra := sum(counts.values()) - nodes) != 0:  # rounding: the biggest kind pays
        counts[max(counts, key=counts.__getitem__)] -= 1 if extra > 0 else -1
    return counts


def build_fleet(db: Database, nodes: int, clock: Clock) -> int:
    """Insert the nodes; returns the number of cards."""
    cards = 0
    with db.session() as s:
        for kind, count in fleet_counts(nodes).items():
            clusters.insert_nodes(s, kind, count, clock)
            cards += count * len(clusters.load(kind).cards)
    return cards


def _pick(rng: random.Random, weighted: tuple[tuple[Any, int], ...]) -> Any:
    return rng.choices([v for v, _ in weighted], weights=[w for _, w in weighted])[0]


def workload(
    tasks: int, tenants: list[str], rng: random.Random
) -> Iterator[tuple[dict[str, Any], list[dict[str, Any]]]]:
    """(group fields, [task fields]) until ``tasks`` tasks; ids and times added later."""
    kinds = {kind: clusters.load(kind) for kind, _ in FLEET_MIX}
    left = tasks
    while left > 0:
        shape = _pick(rng, SHAPES)
        replicas, gpus, util, parallelism = 1, 1, 90, "single"
        if shape == "tp":
            gpus, parallelism = _pick(rng, TP_DEGREES), "tensor_parallel"
        elif shape == "split":
            replicas, parallelism = min(left, rng.randint(2, 4)), "split"
        elif shape == "shared":
            util = rng.randint(20, 50)
        elif shape == "single":
            util = rng.choice((90, 100))
        elif shape == "cpu":
            gpus = 0
        gpu_type, engine, card_mb = "", "vllm", REFERENCE_CARD_MB
        if gpus and rng.random() < PINNED_SHARE:
            k = kinds[_pick(rng, FLEET_MIX)]
            gpu_type, engine, card_mb = k.cards[0].model, next(iter(k.engines)), \
                k.cards[0].memory_total_mb
        if gpus == 0:
            engine = "llamacpp"
        frac = {
            "single": rng.uniform(0.2, 0.8),
            "tp": rng.uniform(0.3, 0.8),
            "split": rng.uniform(0.2, 0.6),
            "shared": util / 100 * rng.uniform(0.5, 0.85),
            "cpu": 0.0,
        }[shape]
        priority = rng.randint(0, 1000)
        group = {
            "tenant_id": rng.choice(tenants),
            "parallelism": parallelism,
            "world_size": gpus if shape == "tp" else replicas,
            "replicas": replicas,
            "gpu_memory_utilization": util,
            "priority": priority,
            "shape": shape,
        }
        task = {
            "gpu_required": gpus,
            "gpu_type": gpu_type,
            "engine": engine,
            "estimated_gpu_memory_mb": int(card_mb * frac),
            "memory_mb": rng.choice((2048, 4096, 8192)) if gpus == 0 else 0,
            "gpu_memory_utilization": util,
            "priority": priority,
        }
        yield group, [dict(task) for _ in range(replicas)]
        left -= replicas


def queue_tasks(db: Database, tasks: int, clock: Clock, seed: int) -> int:
    """Tenants, a sharing group, then the groups and their PENDING tasks in bulk."""
    rng = random.Random(seed)
    now = clock.now()
    share = SharingGroup(id=f"sg-{secrets.token_hex(6)}", name="bench-shared", created_at=now)
    tenant_rows: list[dict[str, Any]] = [
        {
            "id": new_id("tn"),
            "name": f"bench-tenant-{i}",
            "sharing_group_id": share.id if i >= TENANTS - 2 else None,
            "priority_ceiling": 1000,
            "created_at": now,
        }
        for i in range(TENANTS)
    ]
    groups: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for n, (g, specs) in enumerate(workload(tasks, [t["id"] for t in tenant_rows], rng)):
        at = now + timedelta(microseconds=n)  # FIFO inside a priority
        gid = new_id("tg")
        name = f"bench-{g['shape']}-{n}"
        groups.append(
            {
                "id": gid, "tenant_id": g["tenant_id"], "created_by": "bench", "name": name,
                "model_name": name, "task_type": "inference", "parallelism": g["parallelism"],
                "world_size": g["world_size"], "current_replicas": g["replicas"],
                "min_replicas": g["replicas"], "max_replicas": g["replicas"],
                "enable_api": False, "endpoint_id": None,
                "gpu_memory_utilization": g["gpu_memory_utilization"],
                "priority": g["priority"], "labels": {"bench_shape": g["shape"]},
                "status": "pending", "status_message": "", "created_at": at, "updated_at": at,
            }
        )
        for rank, t in enumerate(specs):
            rows.append(
                {
                    **t, "id": new_id("task"), "group_id": gid, "tenant_id": g["tenant_id"],
                    "name": f"{name}-{rank}", "rank": rank, "task_type": "inference",
                    "status": "pending", "status_message": "waiting for the scheduler",
                    "gpu_ids": [], "node_id": None, "model_path": f"/models/{name}",
                    "model_name": name, "engine_reason": "bench",
                    "ports": [{"container_port": 8000, "host_port": 0}],
                    "created_at": at, "updated_at": at,
                }
            )
    with db.session() as s:
        s.add(share)
        s.flush()
        s.execute(insert(Tenant), tenant_rows)
        s.execute(insert(TaskGroup), groups)
        s.execute(insert(Task), rows)
    return len(rows)


def schedule(db: Database, clock: Clock, scale: Scale) -> None:
    """run_round() until a round places nothing, timing each round."""
    sample = int(os.environ.get("HETEROFLOW_SCHEDULER_SAMPLE", "4"))
    scheduler = Scheduler(
        db, clock, interval_s=1, offline_after_s=OFFLINE_AFTER_S, port_pool=PORT_POOL,
        policy=Policy(sample=sample),
    )
    while True:
        start = time.perf_counter()
        result = scheduler.run_round()
        took = time.perf_counter() - start
        scale.rounds.append((result.placed, result.unplaced, took))
        preempted = int(getattr(result, "preempted", 0))
        scale.preempted += preempted
        print(
            f"   round {len(scale.rounds)}: placed {result.placed}, "
            f"unplaced {result.unplaced}, preempted {preempted}, {took:.3f} s",
            file=sys.stderr,
            flush=True,
        )
        per_task = getattr(result, "decision_ms", None)
        if per_task is not None:
            scale.decision_source = "RoundResult.decision_ms (per task, commit included)"
            scale.decision_ms.extend(float(v) for v in per_task)
        elif result.placed:
            scale.decision_source = "round time / tasks placed (no per-task timings)"
            scale.decision_ms.extend([took * 1000 / result.placed] * result.placed)
        if result.placed == 0:
            return


# Per card (node, index) booked by a task that holds a placement: over 100% commitment,
# a whole-card task beside anything, more than one tenant / sharing group, a card index
# the node does not have.
_PER_CARD = """
    WITH h AS (
        SELECT t.node_id, c.value::int AS card,
               CASE WHEN t.gpu_required > 1 OR t.gpu_memory_utilization >= 100
                         OR t.task_type <> 'inference' THEN 100
                    ELSE t.gpu_memory_utilization END AS pct,
               (t.gpu_required > 1 OR t.gpu_memory_utilization >= 100
                OR t.task_type <> 'inference') AS whole,
               COALESCE(tn.sharing_group_id, 'tenant:' || t.tenant_id) AS share_key
        FROM tasks t
        JOIN tenants tn ON tn.id = t.tenant_id
        CROSS JOIN LATERAL json_array_elements_text(t.gpu_ids) AS c(value)
        WHERE t.status IN :held AND t.node_id IS NOT NULL
    )
    SELECT SUM(h.pct) > 100, BOOL_OR(h.whole) AND COUNT(*) > 1,
           COUNT(DISTINCT h.share_key) > 1, BOOL_OR(h.card >= json_array_length(n.gpus))
    FROM h JOIN nodes n ON n.id = h.node_id
    GROUP BY h.node_id, h.card
"""


def pending_causes(messages: list[str]) -> list[tuple[str, int]]:
    """The commonest causes in the pending reasons ("N node(s): cause; ..."), numbers
    masked, with how many pending tasks name each."""
    causes = Counter[str]()
    for msg in messages:
        tail = msg.split(" — ", 1)[-1]
        found = {re.sub(r"\d+", "#", p.split(": ", 1)[-1]) for p in tail.split("; ")}
        causes.update(found)
    return causes.most_common(4)


def audit(db: Database) -> dict[str, Any]:
    """Independent of the scheduler's code: double bookings, packing, what is placed."""
    held = {"held": list(HELD)}
    expanding: BindParameter[list[str]] = bindparam("held", expanding=True)
    with db.engine.connect() as c:
        per_card = c.execute(text(_PER_CARD).bindparams(expanding), held).all()
        lower = c.execute(
            text(
                """
                SELECT COALESCE(SUM(CASE WHEN gpu_required > 1 OR gpu_memory_utilization >= 100
                                              OR task_type <> 'inference' THEN gpu_required
                                         ELSE gpu_memory_utilization / 100.0 END), 0)
                FROM tasks WHERE status IN :held AND gpu_required > 0
                """
            ).bindparams(expanding),
            held,
        ).scalar_one()
        shapes = c.execute(
            text(
                """
                SELECT g.labels::jsonb ->> 'bench_shape', COUNT(*),
                       COUNT(*) FILTER (WHERE t.status IN :held)
                FROM tasks t JOIN task_groups g ON g.id = t.group_id GROUP BY 1 ORDER BY 1
                """
            ).bindparams(expanding),
            held,
        ).all()
        holding = c.execute(
            text("SELECT COUNT(*) FROM tasks WHERE status IN :held").bindparams(expanding), held
        ).scalar_one()
        engine_missing = c.execute(
            text(
                """
                SELECT COUNT(*) FROM tasks t JOIN nodes n ON n.id = t.node_id
                WHERE t.status IN :held AND NOT (n.engines::jsonb ? t.engine)
                """
            ).bindparams(expanding),
            held,
        ).scalar_one()
        pending = c.execute(
            text("SELECT status_message FROM tasks WHERE status = 'pending'")
        ).scalars().all()
    bad = Counter[str]()
    for over, whole_shared, cross, phantom in per_card:
        bad["over_100_pct"] += int(bool(over))
        bad["whole_card_shared"] += int(bool(whole_shared))
        bad["cross_tenant"] += int(bool(cross))
        bad["phantom_card"] += int(bool(phantom))
    used = len(per_card)
    return {
        "holding": int(holding),
        "pending": len(pending),
        "cards_used": used,
        "lower_bound_cards": float(lower),
        "packing_efficiency": round(float(lower) / used, 4) if used else None,
        "double_bookings": sum(1 for o, w, x, _ in per_card if o or w or x),
        "violations": dict(bad),
        "engine_not_on_node": int(engine_missing),
        "shapes": {str(s): (int(q), int(p)) for s, q, p in shapes},
        "pending_causes": pending_causes([str(m) for m in pending]),
    }


def run_scale(nodes: int, tasks: int, seed: int) -> Scale:
    scale = Scale(nodes=nodes)
    clock = SystemClock()
    with fresh_database() as url:
        db = Database.from_url(url)
        try:
            start = time.perf_counter()
            migrate(db.engine)
            scale.setup_db_s = time.perf_counter() - start
            start = time.perf_counter()
            scale.cards = build_fleet(db, nodes, clock)
            scale.setup_nodes_s = time.perf_counter() - start
            start = time.perf_counter()
            scale.queued = queue_tasks(db, tasks, clock, seed)
            scale.setup_tasks_s = time.perf_counter() - start
            schedule(db, clock, scale)
            scale.audit = audit(db)
        finally:
            db.dispose()
    return scale


def label(nodes: int) -> str:
    return f"{nodes // 1000}k" if nodes % 1000 == 0 else str(nodes)


def report(scales: list[Scale]) -> dict[str, Any]:
    rows: list[tuple[str, Callable[[Scale], str]]] = [
        ("nodes / cards", lambda r: f"{r.nodes:,} / {r.cards:,}"),
        ("setup: db+migrate / nodes / tasks (s)",
         lambda r: f"{r.setup_db_s:.2f} / {r.setup_nodes_s:.2f} / {r.setup_tasks_s:.2f}"),
        ("tasks queued / placements made", lambda r: f"{r.queued:,} / {r.placed:,}"),
        ("at the end: placed / pending (DB)",
         lambda r: f"{r.audit['holding']:,} / {r.audit['pending']:,}"),
        ("rounds / scheduling wall time (s)", lambda r: f"{len(r.rounds)} / {r.sched_s:.2f}"),
        ("first round: placed in (s)", lambda r: f"{r.rounds[0][0]:,} in {r.rounds[0][2]:.2f}"),
        ("tasks preempted", lambda r: f"{r.preempted:,}"),
        ("slowest round (s)", lambda r: f"{max(x[2] for x in r.rounds):.3f}"),
        ("placements per second (placing rounds)", lambda r: f"{r.per_s:,.1f}"),
        ("  ... over all rounds, idle check too", lambda r: f"{r.per_s_all_rounds:,.1f}"),
        ("round time / placement (ms)",
         lambda r: f"{r.sched_s * 1000 / r.placed:.3f}" if r.placed else "n/a"),
        ("decision ms p50 / p99", lambda r: f"{percentile(r.decision_ms, 50):.3f} / "
                                            f"{percentile(r.decision_ms, 99):.3f}"),
        ("cards used / lower bound", lambda r: f"{r.audit['cards_used']:,} / "
                                               f"{r.audit['lower_bound_cards']:,.1f}"),
        ("packing efficiency", lambda r: str(r.audit["packing_efficiency"])),
        ("double bookings", lambda r: f"{r.audit['double_bookings']} {r.audit['violations']}"),
        ("placed on a node without its engine", lambda r: str(r.audit["engine_not_on_node"])),
        ("placed per shape", lambda r: " ".join(
            f"{s} {p}/{q}" for s, (q, p) in r.audit["shapes"].items())),
    ]
    width = max(len(name) for name, _ in rows)
    print(f"{'':{width}}  " + "  ".join(f"{label(r.nodes) + ' nodes':<28}" for r in scales))
    for name, cell in rows:
        print(f"{name:{width}}  " + "  ".join(f"{cell(r):<28}" for r in scales))
    for r in scales:
        print(f"\n{label(r.nodes)} nodes, decision time from: {r.decision_source or 'n/a'}")
        for cause, n in r.audit["pending_causes"]:
            print(f"  {n:>6} pending task(s) give: {cause}")
    out: dict[str, Any] = {"placements_per_s_1k": None, "placements_per_s_10k": None}
    for r in scales:
        key = label(r.nodes)
        out[f"placements_per_s_{key}"] = round(r.per_s, 1)
        out[f"placements_per_s_all_rounds_{key}"] = round(r.per_s_all_rounds, 1)
        out[f"p50_decision_ms_{key}"] = round(percentile(r.decision_ms, 50), 3)
        out[f"p99_decision_ms_{key}"] = round(percentile(r.decision_ms, 99), 3)
        out[f"round_ms_per_placement_{key}"] = (
            round(r.sched_s * 1000 / r.placed, 3) if r.placed else None
        )
        out[f"packing_efficiency_{key}"] = r.audit["packing_efficiency"]
        out[f"double_bookings_{key}"] = r.audit["double_bookings"]
        out[f"engine_not_on_node_{key}"] = r.audit["engine_not_on_node"]
        out[f"placements_{key}"] = r.placed
        out[f"holding_at_end_{key}"] = r.audit["holding"]
        out[f"queued_{key}"] = r.queued
        out[f"rounds_{key}"] = len(r.rounds)
        out[f"preempted_{key}"] = r.preempted
        out[f"setup_db_s_{key}"] = round(r.setup_db_s, 2)
        out[f"setup_nodes_s_{key}"] = round(r.setup_nodes_s, 2)
        out[f"setup_tasks_s_{key}"] = round(r.setup_tasks_s, 2)
    # headline figures: the worst over the fleet sizes run
    out["p50_decision_ms"] = max(out[f"p50_decision_ms_{label(r.nodes)}"] for r in scales)
    out["p99_decision_ms"] = max(out[f"p99_decision_ms_{label(r.nodes)}"] for r in scales)
    effs = [r.audit["packing_efficiency"] for r in scales if r.audit["packing_efficiency"]]
    out["packing_efficiency"] = min(effs) if effs else None
    out["double_bookings"] = sum(r.audit["double_bookings"] for r in scales)
    out["decision_timing"] = "per_task" if all(
        r.decision_source.startswith("RoundResult") for r in scales
    ) else "round_average"
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--nodes", default="1000,10000", help="fleet sizes, comma separated")
    ap.add_argument("--tasks", type=int, default=10000, help="tasks queued per fleet size")
    ap.add_argument("--quick", action="store_true", help="100 nodes, 1,000 tasks")
    ap.add_argument("--seed", type=int, default=7, help="workload seed")
    args = ap.parse_args(argv)
    sizes = [100] if args.quick else [int(n) for n in args.nodes.split(",") if n.strip()]
    tasks = 1000 if args.quick else args.tasks
    scales = []
    for nodes in sizes:
        print(f"-- {nodes:,} nodes, {tasks:,} tasks ...", file=sys.stderr, flush=True)
        scales.append(run_scale(nodes, tasks, args.seed))
    summary = report(scales)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
