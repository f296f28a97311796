"""CLI commands that talk to a server's management API (login, services, tenants...)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from heteroflow.settings import default_data_dir

CLI_FILE = "cli.json"


class CliError(SystemExit):
    pass


def _state_path() -> Path:
    return Path(os.environ.get("HETEROFLOW_CLI_DIR", str(default_data_dir()))) / CLI_FILE


def save_login(server: str, token: str) -> None:
    path = _state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"server": server, "token": token}))
    path.chmod(0o600)


def _client(server: str | None = None) -> httpx.Client:
    path = _state_path()
    state: dict[str, str] = json.loads(path.read_text()) if path.exists() else {}
    base = server or state.get("server") or "http://127.0.0.1:3333"
    token = state.get("token", "")
    if not token:
        raise CliError("not logged in: run `heteroflow login` first")
    return httpx.Client(
        base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30
    )


def _check(r: httpx.Response) -> Any:
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            where = f" (field: {err['field']})" if err.get("field") else ""
            raise CliError(f"error {r.status_code}: {err['message']}{where}")
        except (ValueError, KeyError):
            raise CliError(f"error {r.status_code}: {r.text[:300]}") from None
    return r.json() if r.content else None


def login(server: str, username: str, password: str) -> None:
    r = httpx.post(
        f"{server.rstrip('/')}/api/v1/auth/login",
        json={"username": username, "password": password},
        timeout=30,
    )
    save_login(server.rstrip("/"), _check(r)["access_token"])
    print(f"logged in to {server} as {username}")


def _task_note(t: dict[str, Any]) -> str:
    """A pending task's whole reason (why it is not placed); else the message's first line."""
    message = str(t["status_message"]).strip()
    if not message:
        return ""
    if t["status"] == "pending":
        return "why pending: " + "\n      ".join(message.splitlines())
    return message.splitlines()[0]


def _print_group(g: dict[str, Any]) -> None:
    print(f"{g['id']}  {g['name']}  model={g['model_name']}  status={g['status']}")
    if g.get("status_message"):
        print(f"  {g['status_message']}")
    for t in g.get("tasks", []):
        where = t["node_id"] or "-"
        ports = ",".join(f"{p['container_port']}->{p['host_port']}" for p in t["ports"])
        print(f"  {t['id']}  rank={t['rank']}  {t['status']}  node={where}  ports={ports}")
        note = _task_note(t)
        if note:
            print(f"    {note}")


def create_service(body: dict[str, Any], wait: bool, timeout_s: float = 600) -> None:
    with _client() as c:
        g = _check(c.post("/api/v1/task-groups", json=body))
        print(f"created {g['id']} (endpoint {g['endpoint']})")
        if g.get("api_key"):
            print(f"API key (shown once): {g['api_key']}")
        for w in g.get("warnings", []):
            print(f"warning: {w}", file=sys.stderr)
        if not wait:
            return
        last, deadline = ("", ""), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            g = _check(c.get(f"/api/v1/task-groups/{g['id']}"))
            reason = next((t["status_message"] for t in g["tasks"] if t["status_message"]), "")
            reason = reason.splitlines()[0] if reason else ""
            if (g["status"], reason) != last:  # a pending reason that changes is news too
                print(f"  {g['status']}" + (f" — {reason}" if reason else ""))
                last = (g["status"], reason)
            if g["status"] in ("running", "failed", "stopped"):
                return
            time.sleep(0.5)
        raise CliError("timed out waiting for the service to run")


def list_services() -> None:
    with _client() as c:
        for g in _check(c.get("/api/v1/task-groups")):
            _print_group(g)


def show_service(group_id: str) -> None:
    with _client() as c:
        _print_group(_check(c.get(f"/api/v1/task-groups/{group_id}")))


def delete_service(group_id: str) -> None:
    with _client() as c:
        _check(c.delete(f"/api/v1/task-groups/{group_id}"))
    print(f"deleted {group_id}")


def get(path: str) -> None:
    with _client() as c:
        print(json.dumps(_check(c.get(path)), indent=2))


def post(path: str, body: dict[str, Any]) -> None:
    with _client() as c:
        print(json.dumps(_check(c.post(path, json=body)), indent=2))


def patch(path: str, body: dict[str, Any]) -> None:
    with _client() as c:
        print(json.dumps(_check(c.patch(path, json=body)), indent=2))


def delete(path: str) -> None:
    """DELETE; prints the answer when there is one, else what was deleted."""
    with _client() as c:
        answer = _check(c.delete(path))
    print(json.dumps(answer, indent=2) if answer is not None else f"deleted {path}")


def logs(task_id: str, follow: bool = False) -> None:
    """Print a task's output; with ``follow``, keep printing it live until the task ends."""
    after = 0
    with _client() as c:
        while True:
            page = _check(
                c.get(f"/api/v1/tasks/{task_id}/logs", params={"after": after, "limit": 1000})
            )
            for chunk in page["chunks"]:
                sys.stdout.write(chunk["text"])
            sys.stdout.flush()
            if page["next"] == after:
                break
            after = page["next"]
        if not follow:
            return
        params: dict[str, str | int] = {"after": after, "follow": "true"}
        with c.stream(
            "GET", f"/api/v1/tasks/{task_id}/logs", params=params, timeout=None
        ) as r:
            if r.status_code >= 400:
                r.read()
                _check(r)
            for text in r.iter_text():
                sys.stdout.write(text)
                sys.stdout.flush()
