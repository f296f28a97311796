"""How the scheduler decides, on one read of the fleet: a round's decisions and the dry
run's preview are the same calls.

A ``Placer`` holds what a round builds over ``read_fleet``'s views: the ``FleetIndex``
(the ranked order ``place`` walks, stopping after ``Policy.sample`` nodes passed), the
engine chain's candidates for tasks that name no engine (H1), the failure memo and the
preemption planner (B4). ``decide`` places one task and books it into the views,
``decide_gang`` places a pipeline group all or nothing (G1). A scheduler round
(``services.scheduling``) calls them for its queue and writes what they return; the dry
run (``services.dry_run``) calls ``preview`` for a group's planned tasks and shows it —
so a dry run right before a round picks the node and cards the round then books.
Nothing here reads or writes the database.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.core.engines.selection import EngineChoice, NoEngineAvailable, select_engine
from heteroflow.core.placement import (
    FleetIndex,
    NodeView,
    Placement,
    Policy,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
    place,
    place_gang,
    plan_preemption,
)
from heteroflow.core.placement.memo import FailureMemo
from heteroflow.core.placement.preemption import Preemption
from heteroflow.services.placement.fleet import Fleet, engines_of


@dataclass(frozen=True, slots=True)
class Intent:
    """What of a task, besides its ``TaskDemand``, steers the decision: the image (the
    node's engine chain reads it when the task names no engine) and whether it names an
    engine or a command (then the chain is not asked)."""

    image: str
    named: bool


@dataclass(slots=True)
class Outcome:
    """One task's decision: where (booked into the views), or the pending reason."""

    placement: Placement | None
    node: NodeView | None = None
    choice: EngineChoice | None = None  # the node's engine for a task naming none (H1)
    reason: str = ""
    preemption: Preemption | None = None  # lower-priority work to stop first (B4)


class Placer:
    """The round's placement state over one ``Fleet``: index, caches and bookings."""

    def __init__(
        self, fleet: Fleet, reservation: Reservation, port_pool: range, policy: Policy
    ) -> None:
        self.res, self.pool, self.policy = reservation, port_pool, policy
        self.views = fleet.views
        self.nodes = fleet.nodes
        self.index = FleetIndex(
            self.nodes,
            pack=policy.packs,
            load_threshold_pct=policy.load_threshold_pct,
            inference_cap=policy.inference_cap,
            reservation=reservation,
        )
        self.engine_cache: dict[str, tuple[list[NodeView], dict[str, EngineChoice], str]] = {}
        self.failed = FailureMemo(policy.load_threshold_pct, policy.inference_cap)

    def engine_candidates(
        self, image: str
    ) -> tuple[list[NodeView], dict[str, EngineChoice], str]:
        """For tasks that name no engine: the nodes whose chain yields one (H1), and why not."""
        if image not in self.engine_cache:
            ok: list[NodeView] = []
            choices: dict[str, EngineChoice] = {}
            why: list[str] = []
            for n in self.nodes:
                try:
                    choice = select_engine(
                        explicit="", label="", image=image, node=engines_of(n)
                    )
                except NoEngineAvailable as exc:
                    why.append(f"{n.name}: {exc}")
                    continue
                ok.append(n)
                choices[n.id] = choice
            reason = "" if ok else "NoEngineAvailable: " + " | ".join(why or ["no node registered"])
            self.engine_cache[image] = (ok, choices, reason)
        return self.engine_cache[image]

    def decide(self, d: TaskDemand, intent: Intent, waiting: int = 0) -> Outcome:
        """Place one task and book it, or say why not (and which preemption, if any, would
        make room). ``waiting``: the victims of this task's earlier preemption that still
        hold their cards (it waits for them rather than preempting again)."""
        # Priority matters only to preemption, which is retried for a higher priority
        # than the one that already found no victims.
        extra = (intent.image, intent.named)
        known = self.failed.lookup(d, extra)
        if known is not None and d.priority <= known[1]:
            return Outcome(None, reason=known[0].reason)
        choices: dict[str, EngineChoice] = {}
        if known is not None:
            r: Placement | Unplaced = known[0]
        elif not intent.named:
            candidates, choices, why = self.engine_candidates(intent.image)
            if not candidates:
                self.failed.record(d, Unplaced(why), 1001, extra)
                return Outcome(None, reason=why)
            r = place(d, self._holders_first(d, candidates, choices), self.res, self.pool,
                      self.policy)
        else:
            r = place(d, self.index.order(d), self.res, self.pool, self.policy)
        if isinstance(r, Placement):
            return Outcome(r, self.book(d, r), choices.get(r.node_id))
        plan, preempting = self._preemption(d, waiting)
        # a found preemption books nothing yet: the next such task may preempt too
        self.failed.record(d, r, -1 if preempting else d.priority, extra)
        return Outcome(None, reason=preempting or r.reason, preemption=plan)

    def _holders_first(
        self, d: TaskDemand, candidates: list[NodeView], choices: dict[str, EngineChoice]
    ) -> list[NodeView]:
        """The engine chain's candidates (fleet order) with the nodes that hold the task's
        model first, as the index walks them for a task that names its engine: ``place``
        stops after ``Policy.sample`` nodes passed, and a holder further on must not be
        missed for it (issue 29)."""
        first = [n for n in self.index.holders(d) if n.id in choices]
        if not first:
            return candidates
        ids = {n.id for n in first}
        return first + [n for n in candidates if n.id not in ids]

    def book(self, d: TaskDemand, p: Placement) -> NodeView:
        node = self.views[p.node_id]
        book(node, p, d)
        self.index.update(node)
        return node

    def _preemption(self, d: TaskDemand, waiting: int) -> tuple[Preemption | None, str]:
        if not self.policy.preemption or d.priority <= 0:
            return None, ""
        if waiting:
            return None, f"waiting for {waiting} preempted task(s) to release their cards"
        # the index hands over exactly the nodes plan_preemption would not skip at once
        candidates = self.index.preemption_candidates(d)
        plan = plan_preemption(d, candidates, self.res, self.pool, self.policy)
        if plan is None:
            return None, ""
        node = self.views[plan.node_id]
        for v in plan.victims:  # taken once: no other task picks the same victims
            for o in node.occupants:
                if o.task_id == v.task_id:
                    o.preempting = True
        names = ", ".join(v.task_id for v in plan.victims)
        return plan, (
            f"preempting {len(plan.victims)} lower-priority task(s) on {node.name} ({names}); "
            "placed once they release their cards"
        )

    def decide_gang(self, demands: list[TaskDemand]) -> list[Outcome]:
        """G1: a pipeline group's stages are placed (and booked) together, or none is."""
        strict = strict_type_reason(demands[0], self.nodes)
        r = Unplaced(strict) if strict else place_gang(
            demands, self.nodes, self.res, self.pool, self.policy
        )
        if isinstance(r, Unplaced):
            return [Outcome(None, reason=r.reason) for _ in demands]
        return [Outcome(p, self.book(d, p)) for d, p in zip(demands, r, strict=True)]

    def preview(self, demands: list[TaskDemand], intent: Intent, gang: bool) -> list[Outcome]:
        """Where a new group's tasks would go now, by the calls a round makes for them
        (its queue: ranks in order; a pipeline group as one gang)."""
        if gang and demands:
            return self.decide_gang(demands)
        return [self.decide(d, intent) for d in demands]


def strict_type_reason(d: TaskDemand, nodes: list[NodeView]) -> str:
    """B7: a pipeline stage that names a gpu_type takes only that type; its nodes being
    offline means wait, no node reporting it at all is a different message."""
    if not d.gpu_type:
        return ""
    having = [
        n for n in nodes
        if n.visible_to(d.tenant_id) and any(c.model == d.gpu_type for c in n.cards)
    ]
    if not having:
        return (
            f"GpuTypeUnavailable: no node this tenant may use reports gpu_type {d.gpu_type!r}; "
            "pipeline stages never fall back to another type"
        )
    if not any(n.online for n in having):
        return (
            f"Waiting: all {len(having)} node(s) with gpu_type {d.gpu_type!r} are offline; "
            "the stages are placed when one returns"
        )
    return ""
