"""Rotating the node token without downtime (issue 18): the server accepts the current
token and, during a rotation, the previous one until it expires or the rotation is
finished; the nodes still on the previous token are listed; `heteroflow rotate-node-token`
drives it and refuses when the token comes from the environment."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from heteroflow.cli import main
from heteroflow.core.clock import FakeClock
from heteroflow.core.errors import Conflict
from heteroflow.server import ServerApp
from heteroflow.services.agents.node_tokens import (
    NODE_TOKEN_SEEN_WINDOW_S,
    NodeTokenState,
    finish_node_token_rotation,
    nodes_on_previous_token,
    rotate_node_token,
)
from heteroflow.settings import ServerSettings

HOUR = 3600.0


@dataclass
class Server:
    app: ServerApp
    client: TestClient
    clock: FakeClock

    def beat(self, token: str, name: str = "node-a", node_id: str = "") -> int:
        """One heartbeat with ``token``; its status (the node id is kept on success)."""
        body: dict[str, Any] = {
            "name": name,
            "address": "127.0.0.1",
            "runtime": "docker",
            "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 1024,
                          "memory_available_mb": 1024},
        }
        r = self.client.post(
            "/api/v1/agent/heartbeat",
            json=body,
            headers={"Authorization": f"Bearer {token}", "X-Heteroflow-Node": node_id},
        )
        if r.status_code == 200:
            self.node_ids[name] = r.json()["node_id"]
        else:
            assert r.json()["error"]["message"] == "invalid node token"
        return r.status_code

    node_ids: dict[str, str]


def _server(db_url: str, tmp_path: Path, clock: FakeClock, **over: Any) -> Iterator[Server]:
    settings = ServerSettings(
        data_dir=tmp_path / "data", database_url=db_url, admin_password="admin-pass-1",
        gateway_token="gw-token-for-tests", **over,
    )
    app = ServerApp(settings, clock=clock)
    with TestClient(app.asgi) as client:
        yield Server(app, client, clock, {})
    app.db.dispose()


@pytest.fixture
def server(db_url: str, tmp_path: Path) -> Iterator[Server]:
    """A server whose node token is the database's (no HETEROFLOW_NODE_TOKEN)."""
    yield from _server(db_url, tmp_path, FakeClock())


def test_both_tokens_work_during_a_rotation_and_only_the_new_one_after(server: Server) -> None:
    old = server.app.node_token
    assert server.beat(old) == 200
    node_id = server.node_ids["node-a"]

    state = rotate_node_token(server.app.db, server.clock, 24 * HOUR)
    new = state.current
    assert new != old and state.previous == old
    server.clock.advance(0.25)  # a token that matches no copy is re-read at most this often
    assert server.beat(new, "node-b") == 200  # the new token works at once
    assert server.beat(old, node_id=node_id) == 200  # and the old one still does
    assert server.beat("not-a-token") == 401

    on_old = nodes_on_previous_token(server.app.db, server.clock.now())
    assert [(n.node_id, n.name) for n in on_old] == [(node_id, "node-a")]

    # node-a switches over; a minute later nothing is on the previous token
    assert server.beat(new, node_id=node_id) == 200
    server.clock.advance(NODE_TOKEN_SEEN_WINDOW_S + 1)
    assert nodes_on_previous_token(server.app.db, server.clock.now()) == []

    assert finish_node_token_rotation(server.app.db)
    server.clock.advance(server.app.settings.node_token_cache_s)  # every copy re-read
    assert server.beat(old, node_id=node_id) == 401
    assert server.beat(new, node_id=node_id) == 200
    assert not finish_node_token_rotation(server.app.db)  # nothing left to finish


def test_the_previous_token_expires_by_itself(server: Server) -> None:
    old = server.app.node_token
    rotate_node_token(server.app.db, server.clock, 1 * HOUR)
    server.clock.advance(HOUR - 1)
    assert server.beat(old) == 200
    server.clock.advance(1)
    assert server.beat(old) == 401


def test_a_rotation_without_grace_ends_the_old_token_at_once(server: Server) -> None:
    old = server.app.node_token
    state = rotate_node_token(server.app.db, server.clock, 0)
    assert state.previous == ""
    server.clock.advance(server.app.settings.node_token_cache_s)
    assert server.beat(old) == 401
    assert server.beat(state.current) == 200


def test_a_second_rotation_waits_for_the_first_to_end(server: Server) -> None:
    first = rotate_node_token(server.app.db, server.clock, 2 * HOUR)
    # starting another would drop the token agents may still use
    with pytest.raises(Conflict, match="rotation is in progress") as exc:
        rotate_node_token(server.app.db, server.clock, 2 * HOUR)
    assert exc.value.field == "node_token"
    server.clock.advance(2 * HOUR)  # expired: a new rotation may start
    second = rotate_node_token(server.app.db, server.clock, 2 * HOUR)
    assert second.previous == first.current
    server.clock.advance(0.25)
    assert server.beat(second.current) == 200
    assert server.beat(first.current) == 200  # the previous one, now
    assert server.beat(first.previous) == 401  # the one before it: gone


def test_a_token_from_the_environment_is_fixed_with_its_previous(
    db_url: str, tmp_path: Path
) -> None:
    for srv in _server(
        db_url, tmp_path, FakeClock(), node_token="new-env-token", node_token_previous="old-env"
    ):
        assert srv.beat("new-env-token") == 200
        assert srv.beat("old-env", node_id=srv.node_ids["node-a"]) == 200
        assert srv.beat(srv.app.node_tokens.current + "x") == 401
        # a stored rotation does not touch it: the environment wins
        rotate_node_token(srv.app.db, srv.clock, HOUR)
        srv.clock.advance(HOUR)
        assert srv.beat("new-env-token") == 200
        assert srv.beat("old-env") == 200
        on_old = nodes_on_previous_token(srv.app.db, srv.clock.now())
        assert on_old == []  # the rotation cleared the notes; old-env's was 1 h ago


def test_the_state_compares_both_tokens_and_honours_the_expiry() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    state = NodeTokenState("cur", "prev", t0)
    assert state.match("cur", t0) == "current"
    assert state.match("prev", t0) is None  # expired at t0
    assert NodeTokenState("cur", "prev", None).match("prev", t0) == "previous"
    assert NodeTokenState("cur").match("", t0) is None  # no previous: "" is no token


def test_the_cli_rotates_shows_and_finishes(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("HETEROFLOW_NODE_TOKEN", raising=False)
    monkeypatch.setenv("HETEROFLOW_DATABASE_URL", db_url)
    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(tmp_path / "data"))
    # the CLI reads the system clock: the server's fake clock starts at the same moment
    for srv in _server(db_url, tmp_path, FakeClock(datetime.now(UTC))):
        assert main(["rotate-node-token", "--show"]) == 0
        old = capsys.readouterr().out.strip()
        assert old == srv.app.node_token
        assert srv.beat(old) == 200
        node_id = srv.node_ids["node-a"]

        assert main(["rotate-node-token", "--previous-valid-hours", "2"]) == 0
        out = capsys.readouterr().out
        new = out.splitlines()[0].removeprefix("new node token: ")
        assert new != old and "--finish" in out
        assert main(["rotate-node-token"]) == 1  # one at a time
        assert "rotation is in progress" in capsys.readouterr().err

        srv.clock.advance(srv.app.settings.node_token_cache_s)  # the rotation is read
        assert srv.beat(old, node_id=node_id) == 200
        assert main(["rotate-node-token", "--status"]) == 0
        out = capsys.readouterr().out
        assert "rotation in progress" in out and f"{node_id}  node-a" in out

        assert main(["rotate-node-token", "--finish"]) == 1  # node-a is still on it
        assert "node-a" in capsys.readouterr().err
        assert main(["rotate-node-token", "--finish", "--force"]) == 0
        assert "rotation finished" in capsys.readouterr().out
        srv.clock.advance(srv.app.settings.node_token_cache_s)
        assert srv.beat(old, node_id=node_id) == 401
        assert srv.beat(new, node_id=node_id) == 200
        assert main(["rotate-node-token", "--status"]) == 0
        assert "no rotation in progress" in capsys.readouterr().out


def test_the_cli_refuses_a_token_set_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETEROFLOW_NODE_TOKEN", "from-the-env")
    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(tmp_path))
    for args in (["rotate-node-token"], ["rotate-node-token", "--finish"],
                 ["rotate-node-token", "--show"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "HETEROFLOW_NODE_TOKEN is set" in err
        assert "HETEROFLOW_NODE_TOKEN_PREVIOUS" in err
