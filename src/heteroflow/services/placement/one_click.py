"""One-click (H2): no image given — the engine and image come from the nodes' reports.

``one_click(req, nodes)`` takes the first online node's template chain (or, with
``task.engine`` named, that engine's image on the first node that reports it); the image is
always one a node reported, never invented. Called by ``planning.plan_group``, the one
validation path of a create and its dry run.
"""

from __future__ import annotations

from typing import Any

from heteroflow.core.engines.selection import NodeEngines
from heteroflow.core.engines.templates import Template, inference_templates
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.placement import NodeView
from heteroflow.schemas.task_groups import TaskGroupCreate
from heteroflow.services.placement.fleet import engines_of

__all__ = ["one_click"]


def one_click(
    req: TaskGroupCreate, nodes: list[NodeView]
) -> tuple[TaskGroupCreate, list[dict[str, str]]]:
    """H2: no image given — take the first template of the online nodes' reports.

    ``nodes``: the fleet read model's views the caller may use; online is the view's
    (``node_offline_after_s``), the same judgement the dry run and the scheduler make.
    Fails before anything is created when no node reports a usable engine; the image is
    always one a node reported, never invented. One-click groups are ``split``.
    """
    if not req.task.model_path:
        raise ValidationFailed(
            "a one-click service (no task.image) needs task.model_path", field="task.image"
        )
    if req.task.engine:  # the request names its engine: one-click picks only its image
        return _one_click_named(req, nodes, req.task.engine)
    chains: list[tuple[NodeEngines, list[Template]]] = []
    for n in nodes:  # in name order, as read
        if n.online:
            view = engines_of(n)
            chain = inference_templates(view)
            if chain:
                chains.append((view, chain))
    if not chains:
        raise ValidationFailed(
            "no online node reports a usable inference engine; name task.image and "
            "task.engine, or start an agent that has one",
            field="task.image",
        )
    view, best = chains[0]
    task_update: dict[str, Any] = {"image": best[0].image, "engine": best[0].engine}
    if not view.vendor:
        task_update["gpu_required"] = 0  # the node has no GPU: a CPU engine on its CPU
    return req.model_copy(
        update={"parallelism": "split", "task": req.task.model_copy(update=task_update)}
    ), [{"engine": t.engine, "image": t.image, "reason": t.reason} for t in best]


def _one_click_named(
    req: TaskGroupCreate, nodes: list[NodeView], engine: str
) -> tuple[TaskGroupCreate, list[dict[str, str]]]:
    """One-click with ``task.engine`` named: the image that engine's template has on the
    first online node that reports it (an explicit choice skips the chain's card gates,
    as H1 does; the node's own probe reported it runs there). One template, no fallback
    chain: E3 never switches a named engine to another. None reported: 400 naming
    ``task.engine`` — never another engine than the one asked for."""
    for n in nodes:  # in name order, as read
        view = engines_of(n)
        if not n.online or engine not in view.available:
            continue
        image = view.available[engine]  # "" on a process node: its own build
        task_update: dict[str, Any] = {"image": image, "engine": engine}
        if not view.vendor or n.cpu_build(engine):  # a CPU engine on the node's CPU
            task_update["gpu_required"] = 0
        reason = f"{engine} named by task.engine; reported available by node {n.name}"
        return req.model_copy(
            update={"parallelism": "split", "task": req.task.model_copy(update=task_update)}
        ), [{"engine": engine, "image": image, "reason": reason}]
    reported = sorted({e for n in nodes if n.online for e in n.engine_images})
    raise ValidationFailed(
        f"task.engine {engine!r}: no online node you may use reports it (they report: "
        f"{', '.join(reported) or 'none'}); name task.image too, pick a reported engine, "
        "or leave task.engine empty for one-click",
        field="task.engine",
    )
