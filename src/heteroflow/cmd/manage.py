"""The management client's root: the commands that talk to a server's management API
(``login``, ``status``, ``services``, ``tasks``, ``tenants``, ``platform``,
``sharing-groups``, ``users``, ``nodes``, ``logs``) turn their arguments into the
request ``remote.py`` (and ``remote_services``, ``remote_changes``, ``remote_tasks``)
sends. Like the agent, it only speaks HTTP to the server.
"""

from __future__ import annotations

import argparse
import getpass
import os
import sys
from collections.abc import Callable

from heteroflow.cmd import (
    remote,
    remote_changes,
    remote_keys,
    remote_models,
    remote_series,  # issue 33
    remote_services,
    remote_tasks,
    status,
    tables,
)
from heteroflow.cmd.errors import EXIT_INTERRUPTED, EXIT_UNREACHABLE, CliError

Command = Callable[[argparse.Namespace], object]


def run(a: argparse.Namespace) -> int:
    if a.cmd == "status":
        return status.run(a.json)
    COMMANDS[a.cmd](a)
    return 0


NOTHING_TYPED = (
    "no password given: type it at a terminal, or give --password, $HETEROFLOW_PASSWORD "
    "or one line on stdin (--password-stdin)"
)


def _login(a: argparse.Namespace) -> None:
    """issue 33: the server is asked first (an unreachable one is one line, before any
    prompt); the password comes from --password, $HETEROFLOW_PASSWORD, one line on stdin
    (--password-stdin, or stdin is not a terminal) or a prompt."""
    remote.check_reachable(a.server)
    remote.login(a.server, a.username, login_password(a))


def login_password(a: argparse.Namespace) -> str:
    password = a.password or os.environ.get("HETEROFLOW_PASSWORD")
    if password:
        return password
    try:
        if a.password_stdin or not sys.stdin.isatty():
            password = sys.stdin.readline().rstrip("\r\n")
        else:
            password = getpass.getpass(f"password for {a.username} at {a.server}: ")
    except EOFError:
        password = ""
    except KeyboardInterrupt:
        print(file=sys.stderr)
        raise CliError("interrupted: not logged in", EXIT_INTERRUPTED) from None
    if not password:
        raise CliError(NOTHING_TYPED, EXIT_UNREACHABLE)
    return password


def _create_body(a: argparse.Namespace) -> dict[str, object]:
    task: dict[str, object] = {"image": a.image, "gpu_required": a.gpus}
    if a.model_path:
        task["model_path"] = a.model_path
    if a.engine:
        task["engine"] = a.engine
    if a.engine_arg:
        task["engine_args"] = a.engine_arg
    if a.volume:
        task["volumes"] = a.volume  # A2
    if a.not_preemptible:
        task["preemptible"] = False
    body: dict[str, object] = {"name": a.name, "task": task}
    if a.model_name:
        body["model_name"] = a.model_name
    if a.priority is not None:
        body["priority"] = a.priority
    return body


def _update_body(a: argparse.Namespace) -> dict[str, object]:
    """issue 14 (J1, J2): what `services update` sends."""
    update: dict[str, object] = {"strategy": a.strategy, "batch_size": a.batch_size}
    if a.image:
        update["image"] = a.image
    if a.engine_arg is not None:
        update["engine_args"] = a.engine_arg
    if a.env is not None:
        update["env"] = a.env
    return update


def _autoscale_body(a: argparse.Namespace) -> dict[str, object]:
    """issue 14 (I1): what `services autoscale` sends; a flag left out keeps its value.
    ``--disable`` turns it off; ``--metric``/``--target``, or no flag at all, turn it on;
    only ``--min``/``--max`` leave it as stored (issue 33: the range alone, no metric)."""
    range_only = a.metric is None and a.target is None and (a.min, a.max) != (None, None)
    body: dict[str, object] = {} if range_only and not a.disable else {"enabled": not a.disable}
    for key, value in (
        ("metric", a.metric), ("target", a.target), ("min_replicas", a.min),
        ("max_replicas", a.max),
    ):
        if value is not None:
            body[key] = value
    return body


def _window_changes(a: argparse.Namespace) -> tuple[str, dict[str, object]]:
    """issue 14 (K1): what `services window` does (show / set / disable / enable /
    remove) and, to set, the fields given (the others keep their stored values)."""
    changes: dict[str, object] = {
        key: value
        for key, value in (
            ("start", a.start), ("end", a.end), ("timezone", a.timezone), ("days", a.days),
            ("action", a.window_action), ("replicas", a.replicas),
        )
        if value is not None
    }
    modes = [m for m in ("disable", "enable", "remove") if getattr(a, m)]
    if modes and changes:
        raise CliError(f"--{modes[0]} takes no other option")
    if modes:
        return modes[0], {}
    return ("set" if changes else "show"), changes


def _window(a: argparse.Namespace) -> None:
    mode, changes = _window_changes(a)
    remote_changes.window_service(a.id, changes, mode, as_json=a.json)


SERVICE_ACTIONS: dict[str, Command] = {
    "create": lambda a: remote_services.create_service(
        _create_body(a), wait=a.wait, timeout_s=a.timeout, as_json=a.json
    ),
    "list": lambda a: remote_services.list_services(as_json=a.json),
    "show": lambda a: remote_services.show_service(a.id, as_json=a.json),
    "delete": lambda a: remote_services.delete_service(a.id, wait=a.wait, timeout_s=a.timeout),
    # issue 13: the service's desired state
    "stop": lambda a: remote_services.stop_service(a.id, wait=a.wait, timeout_s=a.timeout),
    "start": lambda a: remote_services.start_service(a.id, wait=a.wait, timeout_s=a.timeout),
    "restart": lambda a: remote_services.restart_service(a.id, wait=a.wait, timeout_s=a.timeout),
    "top": lambda a: remote_series.top(a.id, a.since, as_json=a.json),  # issue 33
    "update": lambda a: remote_changes.update_service(
        a.id, _update_body(a), wait=a.wait, timeout_s=a.timeout, as_json=a.json
    ),
    "sleep": lambda a: remote_services.sleep_service(a.id, as_json=a.json),
    "wake": lambda a: remote_services.wake_service(
        a.id, wait=a.wait, timeout_s=a.timeout, as_json=a.json
    ),
    # issue 14 (I1, I2): scale and autoscale; (K1) the schedule window
    "scale": lambda a: remote_changes.scale_service(
        a.id, a.replicas, wait=a.wait, timeout_s=a.timeout, as_json=a.json
    ),
    "autoscale": lambda a: remote_changes.autoscale_service(
        a.id, _autoscale_body(a), as_json=a.json
    ),
    "window": _window,
}

TASK_ACTIONS: dict[str, Command] = {
    "show": lambda a: remote_tasks.show_task(a.id, as_json=a.json),
    "stop": lambda a: remote_tasks.stop_task(a.id, wait=a.wait, timeout_s=a.timeout),
    "sleep": lambda a: remote_tasks.sleep_task(a.id, as_json=a.json),
    "wake": lambda a: remote_tasks.wake_task(
        a.id, wait=a.wait, timeout_s=a.timeout, as_json=a.json
    ),
}


def _users(a: argparse.Namespace) -> None:
    if a.action == "create":
        body = {"username": a.username, "password": a.password, "role": a.role}
        if a.tenant_id:
            body["tenant_id"] = a.tenant_id
        remote.post("/api/v1/users", body, tables.user_block, a.json)
    else:
        remote.get_list("/api/v1/users", tables.users_table, a.json, "users")


def _tenants(a: argparse.Namespace) -> None:
    if a.action == "list":
        remote.get_list("/api/v1/tenants", tables.tenants_table, a.json, "tenants")
        return
    if a.action == "quota":
        remote.get(f"/api/v1/tenants/{a.id}/quota", tables.quota_block, a.json)
        return
    body: dict[str, object] = {"name": a.name} if a.action == "create" else {}
    if a.priority_ceiling is not None:
        body["priority_ceiling"] = a.priority_ceiling
    for name in ("quota_cards", "quota_services", "quota_replicas", "quota_cpu_memory_mb",
                 "quota_tokens", "quota_token_period", "members_see_own"):
        if getattr(a, name, None) is not None:
            body[name] = getattr(a, name)
    if a.sharing_group is not None:
        body["sharing_group_id"] = None if a.sharing_group == "none" else a.sharing_group
    if a.action == "create":
        remote.post("/api/v1/tenants", body, tables.tenant_block, a.json)
    else:
        remote.patch(f"/api/v1/tenants/{a.id}", body, tables.tenant_block, a.json)


def _platform(a: argparse.Namespace) -> None:
    path = "/api/v1/platform-settings"
    if a.action == "show":
        remote.get(path, as_json=a.json)
        return
    body = {
        name: value == "on"
        for name, value in (
            ("inference_dedup_enabled", a.inference_dedup),
            ("cross_tenant_dedup_enabled", a.cross_tenant_dedup),
        )
        if value is not None
    }
    if not body:
        raise CliError("nothing to set: give --inference-dedup and/or --cross-tenant-dedup")
    remote.put(path, body, as_json=a.json)


def _sharing_groups(a: argparse.Namespace) -> None:
    base = "/api/v1/sharing-groups"
    block = tables.sharing_group_block
    if a.action == "list":
        remote.get_list(base, tables.sharing_groups_table, a.json, "sharing groups")
    elif a.action == "show":
        remote.get(f"{base}/{a.id}", block, a.json)
    elif a.action == "create":
        remote.post(base, {"name": a.name}, block, a.json)
    elif a.action == "delete":
        remote.delete(f"{base}/{a.id}", block, a.json)
    elif a.action == "add-tenant":
        remote.post(f"{base}/{a.id}/tenants", {"tenant_id": a.tenant_id}, block, a.json)
    elif a.action == "remove-tenant":
        remote.delete(f"{base}/{a.id}/tenants/{a.tenant_id}", block, a.json)


def _keys(a: argparse.Namespace) -> None:
    if a.action in ("rotate", "revoke"):
        remote_keys.rotate_key(a.id, as_json=a.json, show=a.action == "rotate")
    else:
        remote_keys.list_keys(a.service, as_json=a.json)


def _usage(a: argparse.Namespace) -> None:
    params = {"group_by": a.group_by}
    for name, value in (("start", a.start), ("end", a.end), ("service_id", a.service)):
        if value:
            params[name] = value
    if a.gpu:
        params["gpu"] = "true"
    remote_keys.show_usage(params, as_json=a.json)


COMMANDS: dict[str, Command] = {
    "login": _login,
    "keys": _keys,  # issue 33
    "usage": _usage,
    "services": lambda a: SERVICE_ACTIONS[a.action](a),
    "tasks": lambda a: TASK_ACTIONS[a.action](a),
    "tenants": _tenants,
    "platform": _platform,
    "sharing-groups": _sharing_groups,
    "users": _users,
    "nodes": lambda a: remote.get_list("/api/v1/nodes", tables.nodes_table, a.json, "nodes"),
    "logs": lambda a: remote_tasks.logs(a.task_id, follow=a.follow),
    "models": remote_models.run,  # issue 29: the nodes' model caches
}
