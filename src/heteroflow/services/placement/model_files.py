"""The model file as the server can read it, for the checks a create and its dry run
make before anything is written (issue 33): a GGUF no engine could load is a 400 naming
``task.model_path``; the memory estimate (B8) sizes it; the chat template its GGUF needs
(``core.engines.chat_templates``) shows in the dry run.

A name (a relative ``model_path``) is found as a node's agent finds it
(``agent.models.resolve_model_file``): ``NAME`` or ``NAME.gguf`` under one of the node's
allowed prefixes — here, of the nodes the tenant may use, on the server's own file system
(an all-in-one ``up``: the same one), the real path still inside that node's rule. A
path only the nodes hold is theirs to check: every function here then says nothing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from heteroflow.core.containers import MODEL_IN_IMAGE
from heteroflow.core.engines.chat_templates import chat_template_args
from heteroflow.core.engines.registry import engine_context
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.estimate import MemoryEstimate
from heteroflow.core.paths import GGUF_ONLY, volume_allows
from heteroflow.core.placement import NodeView
from heteroflow.models.estimate import estimate_model_path, gguf_meta_of, gguf_problem
from heteroflow.schemas.task_groups import TaskSpec


def model_here(model_path: str, nodes: Sequence[NodeView]) -> Path | None:
    """Where the server reads ``model_path``: itself when absolute (the path rule of the
    create held it inside the nodes' allow-list); a name under the first node prefix
    that holds it, as the agent looks; None for a source (``hf://``, a URL) or a name
    no prefix here holds."""
    if not model_path or "://" in model_path:
        return None
    if model_path.startswith("/"):
        return Path(model_path)
    for node in nodes:
        for base in node.allowed_volume_prefixes:
            for candidate in (Path(base) / model_path, Path(base) / f"{model_path}.gguf"):
                if not candidate.exists():
                    continue
                real = os.path.realpath(candidate)  # a link may not lead out of the rule
                denied = node.denied_volume_prefixes
                if volume_allows(real, node.allowed_volume_prefixes, denied):
                    return Path(real)
    return None


def check_model_file(spec: TaskSpec, engine: str, nodes: Sequence[NodeView]) -> None:
    """A GGUF the server can read and no engine could load (empty, not GGUF, a cut
    header, fewer bytes than its tensors need) is a 400 naming ``task.model_path``, not
    a 201 for a service that fails on its node."""
    path = model_here(spec.model_path, nodes)
    if path is None or (engine not in GGUF_ONLY and path.suffix != ".gguf"):
        return
    problem = gguf_problem(path)
    if problem:
        raise ValidationFailed(f"task.model_path: {problem}", field="task.model_path")


def estimate(spec: TaskSpec, engine: str, nodes: Sequence[NodeView]) -> MemoryEstimate | None:
    """The model's memory need when the server can read the model (else None: skipped),
    its KV cache sized for the context the engine runs with (its arguments', or the
    platform's default: ``registry.context_args``)."""
    if engine in MODEL_IN_IMAGE:
        return None  # a folder inside the image: nothing here
    path = model_here(spec.model_path, nodes)
    if path is None:
        return None
    args = spec.command or spec.engine_args  # a custom command is the whole line
    return estimate_model_path(path, engine_context=engine_context(engine, args))


def template_args(spec: TaskSpec, engine: str, nodes: Sequence[NodeView]) -> tuple[str, ...]:
    """The ``--chat-template`` the agent adds for this model, where the server reads it."""
    path = model_here(spec.model_path, nodes)
    meta: dict[str, Any] | None = gguf_meta_of(path) if path is not None else None
    return chat_template_args(engine, spec.engine_args, meta)
