"""What the CLI prints: aligned tables and ``key: value`` blocks from the API's JSON.

Pure functions (no I/O): each takes the API's answer as decoded JSON and returns text.
They read fields with defaults, so an answer with a field more or less still prints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

EMPTY = "-"
REASON_WIDTH = 60
ACTIVE_TASK = frozenset({"pending", "scheduled", "starting", "running"})


def cell(value: Any) -> str:
    """A value as one table cell: ``-`` for nothing, one line."""
    if value is None or value == "" or value == []:
        return EMPTY
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.1f}"
    return " ".join(str(value).split())


def truncate(text: str, width: int = REASON_WIDTH) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def columns(rows: Iterable[Sequence[Any]]) -> str:
    """Rows of cells aligned on the widest cell, two spaces apart, no trailing spaces."""
    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))] if cells else []
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells
    )


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A header line, then the rows, columns aligned (see ``columns``)."""
    return columns([headers, *rows])


def kv(pairs: Sequence[tuple[str, Any]]) -> str:
    """``key: value`` lines, values aligned; a value of several lines continues indented."""
    width = max((len(k) for k, _ in pairs), default=0) + 1
    lines = []
    for key, value in pairs:
        text = EMPTY if value is None or value == "" else str(value)
        first, *rest = text.splitlines() or [EMPTY]
        lines.append(f"{key + ':':<{width}} {first}".rstrip())
        lines.extend(" " * (width + 1) + line for line in rest)
    return "\n".join(lines)


def when(value: Any) -> str:
    """An API timestamp (ISO 8601) as ``YYYY-MM-DD HH:MM:SS`` (UTC as the API gives it)."""
    if not value:
        return EMPTY
    text = str(value).replace("T", " ")
    return text[:19] if len(text) >= 19 else text


def first_line(text: Any) -> str:
    lines = str(text or "").strip().splitlines()
    return lines[0].strip() if lines else ""


# ---- services (task groups) -------------------------------------------------------


def _tasks(group: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(group.get("tasks") or [])


def replicas(group: Mapping[str, Any]) -> str:
    """``running/desired``: tasks running over the replicas the group asks for."""
    tasks = _tasks(group)
    running = sum(1 for t in tasks if t.get("status") == "running")
    desired = group.get("current_replicas")
    if not isinstance(desired, int):
        desired = sum(1 for t in tasks if t.get("status") in ACTIVE_TASK) or len(tasks)
    return f"{running}/{desired}"


def group_reason(group: Mapping[str, Any]) -> str:
    """Why a service is not running, in one line: the first task not running that says
    why (a failed one first), else the group's own message; "" when it runs."""
    tasks = _tasks(group)
    ranked = sorted(
        (t for t in tasks if t.get("status") != "running" and first_line(t.get("status_message"))),
        key=lambda t: (t.get("status") != "failed", t.get("rank", 0)),
    )
    if ranked:
        return first_line(ranked[0].get("status_message"))
    if group.get("status") == "running":
        return ""
    return first_line(group.get("status_message"))


def services_table(groups: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        (
            g.get("id"),
            g.get("name"),
            g.get("model_name"),
            g.get("status"),
            replicas(g),
            g.get("endpoint"),
            truncate(group_reason(g)),
        )
        for g in groups
    ]
    return table(("ID", "NAME", "MODEL", "STATUS", "REPLICAS", "ENDPOINT", "REASON"), rows)


def port(p: Mapping[str, Any]) -> str:
    """One port in Docker's direction, as the console writes it too: ``host->container``
    (``21000->8000``); a port not booked on a host yet is its container port alone."""
    host, container = p.get("host_port"), p.get("container_port")
    return f"{host}->{container}" if host else str(container)


def ports(task: Mapping[str, Any]) -> str:
    return ",".join(port(p) for p in task.get("ports") or [])


def tasks_table(tasks: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        (
            t.get("id"),
            t.get("rank"),
            t.get("status"),
            t.get("node_id"),
            ",".join(str(i) for i in t.get("gpu_ids") or []),
            ports(t),
            truncate(first_line(t.get("status_message"))),
        )
        for t in sorted(tasks, key=lambda t: t.get("rank", 0))
    ]
    return table(("TASK", "RANK", "STATUS", "NODE", "GPUS", "PORTS", "MESSAGE"), rows)


def _pending_reasons(tasks: Sequence[Mapping[str, Any]]) -> list[str]:
    """The whole reason of every pending task (the scheduler's per-node causes)."""
    out: list[str] = []
    for t in tasks:
        message = str(t.get("status_message") or "").strip()
        if t.get("status") == "pending" and message:
            out.append(f"why {t.get('id')} is pending:")
            out.extend("  " + line for line in message.splitlines())
    return out


_CAPABILITY_NAMES = ("chat", "tools", "vision", "embeddings", "json_schema")


def capabilities_line(caps: object) -> str:
    """Issue 15: e.g. ``chat tools json_schema ctx=4096; no: vision embeddings; unknown: -``."""
    if not isinstance(caps, Mapping):
        return EMPTY
    has = [n for n in _CAPABILITY_NAMES if caps.get(n) is True]
    if caps.get("context_length"):
        has.append(f"ctx={caps['context_length']}")
    if caps.get("embedding_dimensions"):
        has.append(f"dims={caps['embedding_dimensions']}")
    lacks = [n for n in _CAPABILITY_NAMES if caps.get(n) is False]
    unknown = [n for n in _CAPABILITY_NAMES if caps.get(n) is None]
    parts = [" ".join(has) or EMPTY]
    if lacks:
        parts.append("no: " + " ".join(lacks))
    if unknown:
        parts.append("unknown: " + " ".join(unknown))
    return "; ".join(parts)


def service_block(group: Mapping[str, Any]) -> str:
    tasks = _tasks(group)
    pairs: list[tuple[str, Any]] = [
        ("id", group.get("id")),
        ("name", group.get("name")),
        ("model", group.get("model_name")),
        ("type", group.get("task_type")),
        ("status", group.get("status")),
        ("replicas", f"{replicas(group)} running"),
        ("endpoint", group.get("endpoint")),
        ("priority", group.get("priority")),
        ("can", capabilities_line(group.get("capabilities"))),
        ("reason", group_reason(group)),
        ("created", when(group.get("created_at"))),
    ]
    if group.get("rolling_update_state"):
        update = f"{group['rolling_update_state']} {group.get('rolling_update_message') or ''}"
        pairs.append(("update", update.strip()))
    parts = [kv(pairs)]
    if tasks:
        parts.append("tasks:\n" + indent(tasks_table(tasks)))
    reasons = _pending_reasons(tasks)
    if reasons:
        parts.append("\n".join(reasons))
    return "\n".join(parts)


def task_block(task: Mapping[str, Any]) -> str:
    message = str(task.get("status_message") or "").strip()
    return kv(
        [
            ("id", task.get("id")),
            ("service", task.get("group_id")),
            ("name", task.get("name")),
            ("rank", task.get("rank")),
            ("status", task.get("status")),
            ("node", task.get("node_id")),
            ("gpus", ",".join(str(i) for i in task.get("gpu_ids") or []) or EMPTY),
            ("ports", ports(task) or EMPTY),
            ("engine", task.get("engine")),
            ("image", task.get("image")),
            ("model path", task.get("model_path")),
            ("draining", cell(bool(task.get("draining")))),
            ("started", when(task.get("started_at"))),
            ("message", message),
        ]
    )


def indent(text: str, by: str = "  ") -> str:
    return "\n".join(by + line if line else line for line in text.splitlines())


# ---- nodes ------------------------------------------------------------------------


def gpu_summary(gpus: Sequence[Mapping[str, Any]]) -> str:
    """``2x A10, 1x T4``; ``-`` for a CPU-only node."""
    counts = Counter(str(g.get("model") or g.get("vendor") or "?") for g in gpus)
    return ", ".join(f"{n}x {model}" for model, n in counts.items()) or EMPTY


def nodes_table(nodes: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        (
            n.get("name"),
            n.get("status"),
            n.get("runtime"),
            gpu_summary(n.get("gpus") or []),
            _percent(n.get("cpu_percent")),
            _percent(n.get("memory_percent")),
            n.get("address"),
        )
        for n in nodes
    ]
    return table(("NAME", "STATUS", "RUNTIME", "GPUS", "CPU%", "MEM%", "ADDRESS"), rows)


def _percent(value: Any) -> str:
    return f"{value:.0f}" if isinstance(value, int | float) else EMPTY


# ---- tenants, users, sharing groups -----------------------------------------------


def tenants_table(tenants: Sequence[Mapping[str, Any]]) -> str:
    rows = [
        (t.get("id"), t.get("name"), t.get("priority_ceiling"), t.get("sharing_group_id"))
        for t in tenants
    ]
    return table(("ID", "NAME", "PRIORITY CEILING", "SHARING GROUP"), rows)


def tenant_block(tenant: Mapping[str, Any]) -> str:
    return kv(
        [
            ("id", tenant.get("id")),
            ("name", tenant.get("name")),
            ("priority ceiling", tenant.get("priority_ceiling")),
            ("sharing group", tenant.get("sharing_group_id")),
            *[
                (f"quota {what}", tenant.get(f"quota_{key}") or "no limit")
                for what, key in _QUOTAS
            ],
            ("quota tokens", _token_quota(tenant)),
            ("members see", "only their own" if tenant.get("members_see_own") else "all"),
            ("created", when(tenant.get("created_at"))),
        ]
    )


def _token_quota(tenant: Mapping[str, Any]) -> str:
    tokens = tenant.get("quota_tokens") or 0
    return f"{tokens} per {tenant.get('quota_token_period') or '?'}" if tokens else "no limit"


_QUOTAS = (
    ("cards", "cards"), ("services", "services"), ("replicas", "replicas"),
    ("CPU memory MB", "cpu_memory_mb"),
)


def quota_block(q: Mapping[str, Any]) -> str:
    """A tenant's quotas against what it holds: "cards  2.5 of 4"."""
    limits, usage = q.get("limits") or {}, q.get("usage") or {}
    rows: list[tuple[str, object]] = [("tenant", f"{q.get('tenant_name')} ({q.get('tenant_id')})")]
    for what, key in _QUOTAS:
        used, limit = usage.get(key, 0), limits.get(key, 0)
        if isinstance(used, float) and used.is_integer():
            used = int(used)
        rows.append((what, f"{used} of {limit}" if limit else f"{used} (no limit)"))
    return kv(rows)


def users_table(users: Sequence[Mapping[str, Any]]) -> str:
    rows = [(u.get("id"), u.get("username"), u.get("role"), u.get("tenant_id")) for u in users]
    return table(("ID", "USERNAME", "ROLE", "TENANT"), rows)


def user_block(user: Mapping[str, Any]) -> str:
    return kv(
        [
            ("id", user.get("id")),
            ("username", user.get("username")),
            ("role", user.get("role")),
            ("tenant", user.get("tenant_id")),
            ("created", when(user.get("created_at"))),
        ]
    )


def _members(group: Mapping[str, Any]) -> str:
    return ", ".join(f"{t.get('name')} ({t.get('id')})" for t in group.get("tenants") or [])


def sharing_groups_table(groups: Sequence[Mapping[str, Any]]) -> str:
    rows = [(g.get("id"), g.get("name"), _members(g)) for g in groups]
    return table(("ID", "NAME", "TENANTS"), rows)


def sharing_group_block(group: Mapping[str, Any]) -> str:
    return kv(
        [
            ("id", group.get("id")),
            ("name", group.get("name")),
            ("tenants", _members(group) or EMPTY),
            ("created", when(group.get("created_at"))),
        ]
    )


def generic_block(answer: Any) -> str:
    """Any answer without a renderer of its own: a dict as ``key: value``."""
    if isinstance(answer, Mapping):
        return kv([(str(k), cell(v)) for k, v in answer.items()])
    return cell(answer)
