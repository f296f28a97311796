"""``heteroflow status``: the platform on one screen, and what is wrong with it.

``collect`` asks the server (health route, servers, nodes, services); ``summarize`` and
``render`` are pure. Exit codes: 0 nothing is wrong, 1 something is (listed under
"what is wrong"), 2 the server cannot be reached or the CLI is not logged in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import httpx

from heteroflow.cmd import remote, tables
from heteroflow.cmd.errors import EXIT_PROBLEM, EXIT_UNREACHABLE, CliError

# the server's default lease TTL (leader_lease_ttl_s), when no leader shows the real one
DEFAULT_LEASE_TTL_S = 15.0
REASON_WIDTH = 80  # a problem's reason on screen (--json has it whole)
SERVICE_ORDER = ("running", "scheduling", "pending", "stopping", "failed", "stopped", "completed")


def collect(c: httpx.Client) -> dict[str, Any]:
    """What the server says, raw. ``servers`` is None where the caller may not list
    them (members: the route is for operators)."""
    health = c.get("/healthz")
    try:
        health_body = health.json() if health.content else {}
    except ValueError:
        health_body = {}
    r = c.get("/api/v1/servers")
    servers = None if r.status_code in (403, 404) else remote.check(r)
    return {
        "url": str(c.base_url).rstrip("/"),
        "health_code": health.status_code,
        "health": health_body if isinstance(health_body, dict) else {},
        "servers": servers,
        "nodes": remote.check(c.get("/api/v1/nodes")),
        "groups": remote.check(c.get("/api/v1/task-groups")),
    }


def _problem(kind: str, subject: str, reason: str) -> dict[str, str]:
    return {"kind": kind, "subject": subject, "reason": reason}


def problems(
    health_ok: bool,
    health_text: str,
    servers: Mapping[str, Any] | None,
    nodes: Sequence[Mapping[str, Any]],
    groups: Sequence[Mapping[str, Any]],
) -> list[dict[str, str]]:
    """What an operator should look at: an unhealthy server, no leader, no or offline
    nodes, failed services, pending tasks (with the scheduler's reason)."""
    out: list[dict[str, str]] = []
    if not health_ok:
        out.append(_problem("server_unhealthy", "server", f"health route says {health_text}"))
    if servers is not None and not servers.get("leader"):
        out.append(
            _problem(
                "no_leader",
                "servers",
                "no server instance holds the controllers lease: nothing is scheduled",
            )
        )
    if not nodes:
        out.append(_problem("no_nodes", "nodes", "no node has registered: nothing can run"))
    for n in nodes:
        if n.get("status") != "online":
            last = tables.when(n.get("last_heartbeat_at"))
            out.append(
                _problem("node_offline", str(n.get("name")), f"offline, last heartbeat {last}")
            )
    for g in groups:
        name = f"{g.get('name')} ({g.get('id')})"
        if g.get("status") == "failed":
            out.append(_problem("service_failed", name, tables.group_reason(g) or "failed"))
        for t in g.get("tasks") or []:
            if t.get("status") == "pending":
                reason = tables.first_line(t.get("status_message")) or "pending"
                out.append(_problem("task_pending", f"{t.get('id')} of {name}", reason))
    return out


def _time(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def lease_ttl_s(servers: Mapping[str, Any]) -> float:
    """The lease TTL the servers run with: the leader renews its lease and heartbeats
    in the same round, so its lease ends one TTL after it was last seen."""
    expires = _time(servers.get("lease_expires_at"))
    for i in servers.get("instances") or []:
        seen = _time(i.get("last_seen_at"))
        if i.get("is_leader") and expires is not None and seen is not None:
            ttl = (expires - seen).total_seconds()
            if ttl > 0:
                return ttl
    return DEFAULT_LEASE_TTL_S


def live_instances(
    instances: Sequence[Mapping[str, Any]], ttl_s: float = DEFAULT_LEASE_TTL_S
) -> tuple[list[Mapping[str, Any]], int]:
    """(the instances that can still be running, how many cannot) — issue 33.

    The server lists every instance seen within three lease TTLs, so a server restarted
    a moment ago was listed twice: the process that stopped and the one that replaced
    it. Not listed: an instance at an address (host, listen address, port) where
    another one started later (one process holds an address at a time), and one last
    seen more than a lease TTL before the newest heartbeat (a running instance
    heartbeats several times per TTL: it missed them all, it has stopped)."""
    heard = [t for t in (_time(i.get("last_seen_at")) for i in instances) if t is not None]
    latest = max(heard, default=None)

    def silent(i: Mapping[str, Any]) -> bool:
        t = _time(i.get("last_seen_at"))
        return latest is not None and t is not None and (latest - t).total_seconds() > ttl_s

    newest: dict[tuple[str, str, int], Mapping[str, Any]] = {}
    for i in instances:
        if not i.get("port"):  # not listening yet: nothing to compare
            continue
        where = (str(i.get("hostname")), str(i.get("address")), int(i["port"]))
        seen = newest.get(where)
        if seen is None or str(i.get("started_at") or "") > str(seen.get("started_at") or ""):
            newest[where] = i
    keep = {id(i) for i in newest.values()}
    live = [i for i in instances if (not i.get("port") or id(i) in keep) and not silent(i)]
    return live, len(instances) - len(live)


def summarize(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The machine-readable summary (``status --json``) of what ``collect`` got."""
    health: Mapping[str, Any] = raw.get("health") or {}
    health_text = str(health.get("status") or f"HTTP {raw.get('health_code')}")
    health_ok = raw.get("health_code") == 200 and health_text == "ok"
    servers: Mapping[str, Any] | None = raw.get("servers")
    nodes: list[Mapping[str, Any]] = list(raw.get("nodes") or [])
    groups: list[Mapping[str, Any]] = list(raw.get("groups") or [])
    instances, stopped = live_instances(
        list(servers.get("instances") or []) if servers is not None else [],
        lease_ttl_s(servers) if servers is not None else DEFAULT_LEASE_TTL_S,
    )
    versions = sorted({str(i.get("version")) for i in instances if i.get("version")})
    if health.get("version"):
        versions = [str(health["version"])]
    by_status = Counter(str(g.get("status")) for g in groups)
    online = sum(1 for n in nodes if n.get("status") == "online")
    found = problems(health_ok, health_text, servers, nodes, groups)
    url = str(raw.get("url", ""))
    return {
        "ok": not found,
        "server": {
            "url": url,
            "reachable": True,
            "health": health_text,
            "version": ", ".join(versions) or None,
        },
        "servers": {
            "visible": servers is not None,
            "leader": servers.get("leader") if servers is not None else None,
            "instances": [
                {
                    k: i.get(k)
                    for k in (
                        "id",
                        "hostname",
                        "address",
                        "port",
                        "pid",
                        "version",
                        "is_leader",
                        "last_seen_at",
                    )
                }
                for i in instances
            ],
            "stopped_instances": stopped,
        },
        "gateway": {"url": f"{url}/v1", "embedded": True, "health": health_text},
        "nodes": {"total": len(nodes), "online": online, "offline": len(nodes) - online},
        "services": {
            "total": len(groups),
            "by_status": {s: by_status[s] for s in _status_order(by_status)},
        },
        "problems": found,
    }


def _status_order(counts: Mapping[str, int]) -> list[str]:
    known = [s for s in SERVICE_ORDER if counts.get(s)]
    return known + sorted(s for s in counts if s not in SERVICE_ORDER)


def _servers_text(servers: Mapping[str, Any]) -> str:
    if not servers["visible"]:
        return "(listed for operators only)"
    instances = servers["instances"]
    head = f"{len(instances)} instance{'s' if len(instances) != 1 else ''}, leader " + (
        servers["leader"] or "none"
    )
    if servers.get("stopped_instances"):
        head += (
            f" ({servers['stopped_instances']} stopped one(s) not listed: replaced at "
            "the same address, or silent for over a lease TTL)"
        )
    rows = [
        (
            i["id"],
            f"{i['hostname']}:{i['port']}" if i.get("port") else i["hostname"],
            f"pid {i['pid']}",
            i.get("version") or tables.EMPTY,
            "leader" if i.get("is_leader") else "",
            f"seen {tables.when(i.get('last_seen_at'))}",
        )
        for i in instances
    ]
    if not rows:
        return head
    return head + "\n" + tables.columns(rows)


def render(summary: Mapping[str, Any]) -> str:
    server, nodes, services = summary["server"], summary["nodes"], summary["services"]
    version = f", version {server['version']}" if server.get("version") else ""
    counts = ", ".join(f"{n} {s}" for s, n in services["by_status"].items())
    block = tables.kv(
        [
            ("server", f"{server['url']}  reachable, health {server['health']}{version}"),
            ("servers", _servers_text(summary["servers"])),
            (
                "gateway",
                f"{summary['gateway']['url']}  served by the server "
                f"(health {summary['gateway']['health']})",
            ),
            ("nodes", f"{nodes['online']} online, {nodes['offline']} offline"),
            ("services", f"{services['total']}" + (f": {counts}" if counts else "")),
        ]
    )
    found = summary["problems"]
    if not found:
        return block + "\n\nnothing is wrong"
    rows = [
        (p["kind"].replace("_", " "), p["subject"], tables.truncate(p["reason"], REASON_WIDTH))
        for p in found
    ]
    listed = tables.table(("PROBLEM", "WHAT", "REASON"), rows)
    text = f"{block}\n\nwhat is wrong ({len(found)}):\n{tables.indent(listed)}"
    if any(p["kind"] in ("service_failed", "task_pending") for p in found):
        text += "\n\nthe whole reasons: heteroflow services show SERVICE_ID"
    return text


def run(as_json: bool) -> int:
    """Print the status; 0 when nothing is wrong, 1 when something is. Unreachable or
    not logged in: a CliError with exit 2 (and with ``as_json`` a summary saying so)."""
    try:
        with remote.session() as c:
            raw = collect(c)
    except CliError as exc:
        if as_json and exc.exit_code == EXIT_UNREACHABLE:
            remote.show({"ok": False, "error": exc.message}, tables.generic_block, True)
        raise
    summary = summarize(raw)
    remote.show(summary, render, as_json)
    return 0 if summary["ok"] else EXIT_PROBLEM
