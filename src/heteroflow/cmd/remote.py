"""The management client's HTTP side: the login state, the logged-in session, the
answer check and the plain calls (login, users, tenants, platform, sharing groups...).

Every failure is a ``CliError``: one line for stderr and an exit code (see
``cmd/errors.py``): 1 when the server said no or a wait ended badly, 2 when the server
cannot be reached or the CLI is not logged in. What the commands print is rendered by
``cmd/tables.py``; ``--json`` prints the API's answer unchanged instead. The commands
that follow a change until it lands are in ``remote_services``, ``remote_changes`` and
``remote_tasks``, over ``waiting``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

import httpx

from heteroflow.cmd import tables
from heteroflow.cmd.errors import EXIT_UNREACHABLE, CliError
from heteroflow.settings import default_data_dir

__all__ = ["CliError"]

CLI_FILE = "cli.json"
DEFAULT_SERVER = "http://127.0.0.1:3333"
NOT_LOGGED_IN = "not logged in: run `heteroflow login --server URL` first"


Render = Callable[[Any], str]


def _state_path() -> Path:
    return Path(os.environ.get("HETEROFLOW_CLI_DIR", str(default_data_dir()))) / CLI_FILE


def save_login(server: str, token: str) -> None:
    path = _state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"server": server, "token": token}))
    path.chmod(0o600)


def _state() -> dict[str, str]:
    path = _state_path()
    if not path.exists():
        return {}
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CliError(
            f"cannot read {path} ({type(exc).__name__}): run `heteroflow login` again",
            EXIT_UNREACHABLE,
        ) from None
    return {str(k): str(v) for k, v in state.items()} if isinstance(state, dict) else {}


def _client(server: str | None = None) -> httpx.Client:
    state = _state()
    base = server or state.get("server") or DEFAULT_SERVER
    token = state.get("token", "")
    if not token:
        raise CliError(NOT_LOGGED_IN, EXIT_UNREACHABLE)
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _unreachable(url: str, exc: httpx.TransportError) -> CliError:
    why = str(exc) or type(exc).__name__
    return CliError(f"cannot reach the server at {url.rstrip('/')}: {why}", EXIT_UNREACHABLE)


@contextmanager
def session() -> Iterator[httpx.Client]:
    """The logged-in client; a connection failure anywhere inside is one line, exit 2."""
    client = _client()
    try:
        with client:
            yield client
    except httpx.TransportError as exc:
        raise _unreachable(str(client.base_url), exc) from None


def check(r: httpx.Response, *, relogin: bool = True) -> Any:
    """The answer's JSON, or a CliError with the API's message (a 401 on a logged-in
    call means the session ended: exit 2 and say to log in again)."""
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            where = f" (field: {err['field']})" if err.get("field") else ""
            message = f"error {r.status_code}: {err['message']}{where}"
        except (ValueError, KeyError, TypeError):
            message = f"error {r.status_code}: {r.text[:300]}"
        if r.status_code == 401 and relogin:
            raise CliError(f"{message}: run `heteroflow login` again", EXIT_UNREACHABLE)
        raise CliError(message)
    if not r.content:
        return None
    try:
        return r.json()
    except ValueError:
        raise CliError(
            f"{r.request.url} answered with something that is not JSON: "
            "is that a HeteroFlow server?"
        ) from None


def check_reachable(server: str) -> None:
    """Ask the server's health route before asking for a password (issue 33): an address
    nobody answers at is one line, exit 2, before anyone types a secret."""
    try:
        httpx.get(f"{server.rstrip('/')}/healthz", timeout=10)
    except httpx.TransportError as exc:
        raise _unreachable(server, exc) from None


def login(server: str, username: str, password: str) -> None:
    server = server.rstrip("/")
    try:
        r = httpx.post(
            f"{server}/api/v1/auth/login",
            json={"username": username, "password": password},
            timeout=30,
        )
    except httpx.TransportError as exc:
        raise _unreachable(server, exc) from None
    save_login(server, check(r, relogin=False)["access_token"])
    print(f"logged in to {server} as {username}")


def print_json(answer: Any, out: TextIO | None = None) -> None:
    print(json.dumps(answer, indent=2), file=out or sys.stdout)


def show(answer: Any, render: Render, as_json: bool) -> None:
    """The API's answer: as JSON (unchanged), or rendered for people (an answer of a
    shape the renderer does not know is printed field by field)."""
    if as_json:
        print_json(answer)
    else:
        print(render(answer) if isinstance(answer, dict) else tables.generic_block(answer))


def show_list(answer: Any, render: Render, as_json: bool, what: str) -> None:
    if as_json:
        print_json(answer)
    elif not isinstance(answer, list):
        raise CliError(f"expected a list of {what} from the server, got: {str(answer)[:200]}")
    elif not answer:
        print(f"no {what}")
    else:
        print(render(answer))


# ---- plain calls -------------------------------------------------------------------


def get(path: str, render: Render = tables.generic_block, as_json: bool = False) -> Any:
    with session() as c:
        answer = check(c.get(path))
    show(answer, render, as_json)
    return answer


def get_list(path: str, render: Render, as_json: bool, what: str) -> Any:
    with session() as c:
        answer = check(c.get(path))
    show_list(answer, render, as_json, what)
    return answer


def post(
    path: str, body: dict[str, Any], render: Render = tables.generic_block, as_json: bool = False
) -> Any:
    with session() as c:
        answer = check(c.post(path, json=body))
    show(answer, render, as_json)
    return answer


def patch(
    path: str, body: dict[str, Any], render: Render = tables.generic_block, as_json: bool = False
) -> Any:
    return _send("PATCH", path, body, render, as_json)


def put(
    path: str, body: dict[str, Any], render: Render = tables.generic_block, as_json: bool = False
) -> Any:
    return _send("PUT", path, body, render, as_json)


def _send(method: str, path: str, body: dict[str, Any], render: Render, as_json: bool) -> Any:
    with session() as c:
        answer = check(c.request(method, path, json=body))
    show(answer, render, as_json)
    return answer


def delete(path: str, render: Render = tables.generic_block, as_json: bool = False) -> None:
    """DELETE; prints the answer when there is one, else what was deleted."""
    with session() as c:
        answer = check(c.delete(path))
    if answer is None:
        print(f"deleted {path}")
    else:
        show(answer, render, as_json)

