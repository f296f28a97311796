"""The recovery loop's decisions (E1, E3, E4, A10), pure: facts in, a decision out.

``services/lifecycle/recovery.py`` reads the facts (a failed task, the attempts behind it, its
group's template chain) and writes what ``decide`` says. Nothing here reads a clock or
a database.

**Which failed task is rebuilt.** Only the current task of a rank (``replaced_by``
empty) of a group that is not deleted and whose owner wants it running. An inference
task is rebuilt whatever failed it: a service is meant to be up. A training or
container task is rebuilt only when what it ran on was lost (its node, its card, its
container removed or killed from outside): its own failure — a non-zero exit, a
failing health check, its run timeout — is its result, and running it again would
repeat the work (or the bug) up to five times. Pipeline groups (training / container
stages placed as one gang) are never rebuilt rank by rank: one stage alone cannot
rejoin the others; the gang is rebuilt as one by ``services/lifecycle/gangs.py``, which
judges its failed stage by these same rules. A completed task is never rebuilt.

**The counter (E1).** The original task of a rank has ``rebuild_count`` 0; each
rebuild in a row adds one; the task that replaces one that had run stably (from
``running_at`` to its failure, at least ``stable_s``) starts again at 1. A rebuild
whose count would pass ``max_rebuilds`` is not made: the loop gives up, once, saying so.

**Engine fallback (E3).** When the failed task never reached ``running`` and the
attempts behind it (this one included) failed to start ``fallback_after`` times in a
row with the same engine on the same node, the rebuild takes the entry after that
engine in the group's ``inference_templates`` (the one-click chain, e.g. vllm -> sglang
-> llamacpp). Its engine arguments are dropped: they were written for the other engine.
A failure that was not the engine's (a lost node or card, a container removed behind
the agent's back) is no start failure and breaks the run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from heteroflow.core.events import EventKind

# Failures that say what the task ran on was lost, not that the task itself failed:
# these move training and container work too (E4), and never count as a start failure.
LOST_HARDWARE = frozenset(
    {EventKind.CONTAINER_LOST, EventKind.EVACUATED, EventKind.GPU_LOST, EventKind.NODE_LOST}
)
# Failures that are the task's own result when it is not a service.
OWN_FAILURE = frozenset(
    {EventKind.ENGINE_EXITED, EventKind.UNHEALTHY, EventKind.LOAD_STALLED, EventKind.RUN_TIMEOUT}
)


@dataclass(frozen=True, slots=True)
class RecoveryPolicy:
    max_rebuilds: int = 5
    stable_s: float = 60.0
    fallback_after: int = 2  # failed starts in a row (same engine, same node) before E3
    # E4's guard: at least this share of the nodes lost at once pauses moving work off
    # lost nodes (``evacuation_paused``)
    disruption_threshold: float = 0.55


@dataclass(frozen=True, slots=True)
class Attempt:
    """One failed task of a rank, as the decision needs it.

    ``fault``: the kind of the last ``fault.*`` event that names this task (None when
    no fault was recorded, e.g. a launch that failed or an agent that shut down).
    """

    task_id: str
    rebuild_count: int
    engine: str
    image: str
    node_id: str | None
    running_at: datetime | None
    failed_at: datetime
    fault: EventKind | None = None

    @property
    def reached_running(self) -> bool:
        return self.running_at is not None

    @property
    def start_failure(self) -> bool:
        """It never ran, and not because what it ran on was lost."""
        return not self.reached_running and self.fault not in LOST_HARDWARE


@dataclass(frozen=True, slots=True)
class Rebuild:
    count: int  # the new task's rebuild_count
    engine: str
    image: str
    engine_reason: str = ""  # set on a fallback: why this engine
    fallback: str = ""  # "" or the sentence the event says about the fallback


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


@dataclass(frozen=True, slots=True)
class Skip:
    """Not the recovery loop's to rebuild (training's own failure, a pipeline stage)."""

    reason: str


Decision = Rebuild | GiveUp | Skip


def ran_stably(a: Attempt, stable_s: float) -> bool:
    return a.running_at is not None and (a.failed_at - a.running_at).total_seconds() >= stable_s


def next_count(a: Attempt, policy: RecoveryPolicy) -> int:
    """The rebuild_count of the task that would replace ``a``."""
    return 1 if ran_stably(a, policy.stable_s) else a.rebuild_count + 1


def rebuildable(task_type: str, parallelism: str, fault: EventKind | None) -> str | None:
    """None when a failed task of this kind is the loop's to rebuild; else why not."""
    if parallelism == "pipeline":
        return "a pipeline stage is not rebuilt alone (its gang would need a restart)"
    if task_type == "inference":
        return None
    if fault in LOST_HARDWARE:
        return None
    return f"a {task_type} task's own failure is its result; start the group to run it again"


def next_template(
    templates: Sequence[Mapping[str, object]], engine: str
) -> Mapping[str, object] | None:
    """The entry after ``engine`` in the chain (None: not in it, or the last)."""
    engines = [str(t.get("engine", "")) for t in templates]
    if engine not in engines:
        return None
    i = engines.index(engine)
    return templates[i + 1] if i + 1 < len(templates) else None


def start_failures_in_a_row(history: Sequence[Attempt]) -> int:
    """``history``: the failed task first, then the one it replaced, and so on. How many
    in a row, from the first, failed to start with its engine on its node."""
    if not history:
        return 0
    head = history[0]
    n = 0
    for a in history:
        if not (a.start_failure and a.engine == head.engine and a.node_id == head.node_id):
            break
        n += 1
    return n


def decide(
    history: Sequence[Attempt],
    templates: Sequence[Mapping[str, object]],
    policy: RecoveryPolicy,
    *,
    task_type: str = "inference",
    parallelism: str = "single",
) -> Decision:
    """What to do about ``history[0]``, a failed current task (the rest: the attempts
    it replaced, newest first, as far back as the caller read — ``fallback_after`` is
    enough)."""
    failed = history[0]
    why_not = rebuildable(task_type, parallelism, failed.fault)
    if why_not is not None:
        return Skip(why_not)
    count = next_count(failed, policy)
    if count > policy.max_rebuilds:
        return GiveUp(
            f"rebuilt {failed.rebuild_count} times in a row without running stably for "
            f"{policy.stable_s:g} s; the recovery loop stops here"
        )
    if failed.fault == EventKind.IMAGE_UNAVAILABLE:
        return _image_unavailable(failed, templates, count)
    if task_type == "inference" and start_failures_in_a_row(history) >= policy.fallback_after:
        nxt = next_template(templates, failed.engine)
        if nxt is not None:
            engine, image = str(nxt.get("engine", "")), str(nxt.get("image", ""))
            return Rebuild(
                count,
                engine,
                image,
                engine_reason=f"fallback after {failed.engine} failed to start "
                f"{policy.fallback_after} times: {nxt.get('reason', '')}".rstrip(": "),
                fallback=f"{failed.engine} failed to start {policy.fallback_after} times "
                f"in a row on its node; falling back to {engine} ({image})",
            )
    return Rebuild(count, failed.engine, failed.image)


def _image_unavailable(
    failed: Attempt, templates: Sequence[Mapping[str, object]], count: int
) -> Decision:
    """H7: the image cannot be pulled until a person acts (not found, unauthorised):
    pulling it again helps nobody. The next engine of a one-click chain is tried at once
    (its image is another); otherwise the loop gives up, saying what to fix."""
    nxt = next_template(templates, failed.engine)
    if nxt is None:
        return GiveUp(
            f"its image {failed.image} cannot be pulled (not found or unauthorised): "
            "pulling again changes nothing; push the image or fix the registry credential, "
            "then start the service again"
        )
    engine, image = str(nxt.get("engine", "")), str(nxt.get("image", ""))
    return Rebuild(
        count,
        engine,
        image,
        engine_reason=f"fallback: the image of {failed.engine} ({failed.image}) cannot be "
        f"pulled: {nxt.get('reason', '')}".rstrip(": "),
        fallback=f"the image of {failed.engine} ({failed.image}) cannot be pulled; "
        f"falling back to {engine} ({image})",
    )


def run_timed_out(
    started: datetime | None, now: datetime, timeout_s: int, task_type: str
) -> bool:
    """A10: a training / container task past its group's run timeout (0 = none);
    inference is exempt by its type."""
    if task_type == "inference" or timeout_s <= 0 or started is None:
        return False
    return (now - started).total_seconds() > timeout_s


def missing_cards(gpu_ids: Sequence[int], inventory: Sequence[int]) -> list[int]:
    """The cards a task is placed on that its node no longer reports (E4)."""
    have = set(inventory)
    return [i for i in gpu_ids if i not in have]


def evacuation_paused(lost: int, online: int, threshold: float) -> bool:
    """Whether moving work off lost nodes waits: the loss looks like the control plane's.

    ``lost``: nodes past the lost-node delay that still hold work to move; ``online``:
    nodes heartbeating now. Nodes fail one by one; when none is heard from at all, or
    ``threshold`` of them and at least two go quiet at once, the likelier cause is on
    this side — the server the agents reach stalled or was cut off, a network split —
    and failing every healthy replica there would turn it into an outage, on a fleet
    that could not take the work anyway. As Kubernetes' node lifecycle controller stops
    evicting in a fully disrupted zone. With no node online there is also nowhere to
    move to. The node watch still records each loss; work moves once the share drops.
    """
    if lost == 0:
        return False
    if online == 0:
        return True
    return lost >= 2 and lost / (lost + online) >= threshold

