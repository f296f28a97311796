"""``heteroflow models`` (issue 29, H9): the nodes' cached models as a table, and a pull or
an eviction on one node, followed until the node's agent answers with ``--wait``.

A pull's source is checked here first by the server's own rule
(``core.model_requests.pull_source``): a mistyped source or a path is one line and exit
2 before anything is asked. With ``--wait`` the request is polled and each change printed
(``  [3s] running — pulling hf://…: 1.2 GB of 4.5 GB``); exit 0 when it is done, 1 with the
node's reason when it failed.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode

from heteroflow.cmd import tables
from heteroflow.cmd.errors import EXIT_UNREACHABLE, CliError
from heteroflow.cmd.remote import check, get_list, print_json, session
from heteroflow.cmd.waiting import DONE, wait_for
from heteroflow.core.errors import ValidationFailed
from heteroflow.core.images import size_text
from heteroflow.core.model_requests import pull_source


def run(a: argparse.Namespace) -> None:
    if a.action == "list":
        query = f"?{urlencode({'node': a.node})}" if a.node else ""
        get_list(f"/api/v1/models/cache{query}", models_table, a.json, "cached models")
    elif a.action == "pull":
        try:
            source = pull_source(a.source).text
        except ValidationFailed as exc:
            raise CliError(exc.message, EXIT_UNREACHABLE) from None
        _ask(a, "pull", {"source": source})
    else:
        _ask(a, "evict", {"key": a.key})


def models_table(rows: Sequence[Mapping[str, Any]]) -> str:
    return tables.table(
        ("NODE", "KEY", "SOURCE", "REVISION", "SIZE", "STATE"),
        [
            (m.get("node"), m.get("key"), m.get("source"), _short(m.get("revision")),
             size_text(int(m.get("size_bytes") or 0)), m.get("state"))
            for m in rows
        ],
    )


def _short(revision: Any) -> str:
    """A commit as its first 12 hex digits (as git shows it); a branch or tag as it is."""
    text = str(revision or "")
    is_commit = len(text) == 40 and all(c in "0123456789abcdef" for c in text)
    return text[:12] if is_commit else text


def request_line(r: Mapping[str, Any]) -> str:
    """``running — pulling hf://…: 1.2 GB of 4.5 GB``."""
    message = tables.first_line(r.get("message"))
    return str(r.get("status", "?")) + (f" — {message}" if message else "")


def _subject(r: Mapping[str, Any]) -> str:
    thing = r.get("source") if r.get("action") == "pull" else r.get("key")
    return f"{r.get('action')} of {thing} on node {r.get('node')}"


def request_outcome(r: Mapping[str, Any]) -> str | None:
    status = r.get("status")
    if status == "done":
        return DONE
    if status == "failed":
        return f"{_subject(r)} failed: {r.get('message') or 'no reason given'}"
    return None


def _ask(a: argparse.Namespace, action: str, body: dict[str, str]) -> None:
    progress = sys.stderr if a.json else sys.stdout
    with session() as c:
        r = check(c.post(f"/api/v1/nodes/{quote(a.node, safe='')}/models/{action}", json=body))
        print(f"{r.get('id')}: {_subject(r)} ({r.get('status')})", file=progress)
        if a.wait:
            r = wait_for(
                lambda: check(c.get(f"/api/v1/model-requests/{r['id']}")),
                line=request_line,
                outcome=request_outcome,
                timeout_s=a.timeout,
                what=f"the {_subject(r)}; see `heteroflow models list --node {a.node}`",
                out=progress,
            )
            print(f"done: {r.get('message') or _subject(r)}", file=progress)
    if a.json:
        print_json(dict(r))
