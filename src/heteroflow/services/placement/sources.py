"""A model source resolved before anything is placed (issue 29, FEATURES H9).

``resolve_source(req, settings, token_of)``: None for a path on the node; for a source
(``core.model_sources``) the files, sizes and revision the source names right now, asked
of the source itself (``models.fetch``: the hub, its mirror, a web server) — or
``SourceFailed``, a 400 naming ``task.model_path`` with the reason (not found,
unauthorised, unreachable, timeout). Only the hubs the operator named are asked: a
``https://`` URL is a tenant's, and the control plane never contacts it (no probing of
the server's network through it); the node resolves it when it fetches. Create and dry
run call it first, before the database is read, so a network wait holds no transaction;
the dry run shows what it found. A hub is asked with the creating tenant's token
(``token_of``: ``services.tenancy.hub_tokens.reader``, read in a short session of its own,
so the wait holds no transaction either), else the server's ``hub_token``. The agent
resolves again when it fetches (a branch may have moved since): the revision shown here
is what the source said at create.

A route runs in a worker thread (FastAPI's sync routes), where no event loop runs: the
resolver's coroutine gets its own loop there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from heteroflow.core.engines import resolve_engine
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.model_sources import FIELD, SourceKind, is_source_url, parse_model_source
from heteroflow.core.paths import model_source_refusal
from heteroflow.core.placement import NodeView
from heteroflow.core.placement.model import source_text
from heteroflow.models.fetch.resolve import SourceResolver
from heteroflow.schemas.task_groups import ModelSourceRead, TaskGroupCreate
from heteroflow.settings import ServerSettings

__all__ = ["SHOWN_FILES", "check_fleet_copy", "resolve_source"]

#: Files listed in the dry run (a hub repository may hold hundreds); the sums count all.
SHOWN_FILES = 50


def resolve_source(
    req: TaskGroupCreate,
    settings: ServerSettings,
    token_of: Callable[[str], str | None] | None = None,
) -> ModelSourceRead | None:
    """``token_of(hub)``: the creating tenant's token for a hub (``hf`` | ``modelscope``),
    or None for the server's own setting; asked only for a hub source."""
    model_path = req.task.model_path
    if not model_path or not is_source_url(model_path):
        return None
    # what its form and engine refuse is said first, without asking the network
    engine, _ = resolve_engine(req.task.engine, req.labels.get("heteroflow.engine", ""),
                               req.task.image)
    refused = model_source_refusal(
        model_path, engine=engine, custom_command=bool(req.task.command)
    )
    if refused:
        raise ValidationFailed(refused, field=FIELD)
    source = parse_model_source(model_path)
    if source.kind is SourceKind.FLEET:
        # a copy some node holds: known from the nodes' own reports, read with the fleet
        # (``check_task`` refuses one nobody holds; the dry run shows the holders' copy)
        return ModelSourceRead(
            source=source.text, kind=source.kind.value, resolved=False, revision="",
            bytes=None, file_count=0, files=[],
        )
    if source.kind is SourceKind.URL:
        # a tenant's URL is never contacted by the control plane (it would probe the
        # server's own network for them: an internal host, its loopback); the node that
        # runs the task resolves and fetches it, and a bad one fails that task with why
        return ModelSourceRead(
            source=source.text, kind=source.kind.value, resolved=False, revision="",
            bytes=None, file_count=0, files=[],
        )
    tenants = token_of(source.kind.value) if token_of is not None else None
    token = tenants or settings.hub_token.get_secret_value() or None
    resolver = SourceResolver(
        hf_endpoint=settings.hf_endpoint,
        modelscope_endpoint=settings.modelscope_endpoint,
        timeout_s=settings.model_resolve_timeout_s,
    )
    manifest = asyncio.run(resolver.resolve(source, token))
    return ModelSourceRead(
        source=source.text,
        kind=source.kind.value,
        revision=manifest.revision,
        bytes=manifest.total_bytes if manifest.sizes_known else None,
        file_count=len(manifest.files),
        files=[
            {"path": f.path, "bytes": f.size, "sha256": f.sha256}
            for f in manifest.files[:SHOWN_FILES]
        ],
    )


def check_fleet_copy(model_path: str, nodes: list[NodeView]) -> None:
    """Issue 29: a ``fleet://`` copy must exist on a node the caller may use (online or
    not: a node back from a restart still holds its cache) — resolved from the fleet's
    own reports, never from the network, so the answer is immediate (``check_task``)."""
    text = source_text(model_path)
    if not text.startswith("fleet://"):
        return
    if any(c.complete and c.fleet == text for n in nodes for c in n.cached_models):
        return
    raise ValidationFailed(
        f"task.model_path: no node you may use holds {text} (`heteroflow models list` "
        "shows the copies nodes hold, by key)",
        field=FIELD,
    )
