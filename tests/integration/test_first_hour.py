"""Issue 12's small dead ends, each as a user met it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from heteroflow import cli
from heteroflow.cmd import up, up_cli
from heteroflow.core.errors import Conflict, NotFound, ValidationFailed
from heteroflow.db.tables import InferenceEndpoint, User
from heteroflow.models.demo import ensure_demo_model
from heteroflow.schemas.routing import hash_key
from heteroflow.services.identity.auth import Principal
from heteroflow.services.serving import endpoints

from .conftest import Api, service_body

PROTECTED = "/api/v1/task-groups"


def test_a_cpu_service_reports_the_world_size_it_was_created_with(api: Api) -> None:
    """``world_size`` 1 in came back 0 for a CPU (0-GPU) service: ranks are not cards."""
    admin = api.login()
    api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(world_size=1), headers=admin)
    assert r.status_code == 201, r.text
    assert r.json()["world_size"] == 1


# ---- `heteroflow up` never leaves a new user without a way in (issue 12, item 2) ----


def _demo_group(api: Api, admin: dict[str, str], name: str) -> dict[str, Any]:
    api.heartbeat()
    r = api.client.post("/api/v1/task-groups", json=service_body(name=name), headers=admin)
    assert r.status_code == 201, r.text
    body: dict[str, Any] = r.json()
    return body


def test_an_endpoint_takes_a_key_its_owner_chose_and_only_a_sound_one(api: Api) -> None:
    """``up`` keeps its demo's key across restarts by setting it on the new endpoint."""
    admin = api.login()
    first, second = _demo_group(api, admin, "one"), _demo_group(api, admin, "two")
    who = up._admin(api.app)
    chosen = "sk-" + "a1b2c3d4" * 4
    with api.app.db.session() as s:
        read = endpoints.set_endpoint_key(s, who, api.clock, first["endpoint"], chosen)
    assert read.key_prefix == chosen[:7] + "…"
    with api.app.db.session() as s:
        e = s.get(InferenceEndpoint, first["endpoint"])
        assert e is not None and e.key_hash == hash_key(chosen)
        old = hash_key(first["api_key"])  # the old key is gone
        assert (
            s.scalar(select(InferenceEndpoint.id).where(InferenceEndpoint.key_hash == old)) is None
        )
        for bad in ("sk-short", "sk-" + "x" * 300, "sk-with space-" + "x" * 20, "sk-é" + "x" * 30):
            with pytest.raises(ValidationFailed):
                endpoints.set_endpoint_key(s, who, api.clock, second["endpoint"], bad)
        with pytest.raises(Conflict):  # another endpoint's key
            endpoints.set_endpoint_key(s, who, api.clock, second["endpoint"], chosen)
    # a member never reaches another tenant's endpoint
    api.member(admin, "other", "bob")
    with api.app.db.session() as s:
        bob = s.scalar(select(User).where(User.username == "bob"))
        assert bob is not None
        as_bob = Principal(bob.id, bob.username, bob.tenant_id, bob.role)
        with pytest.raises(NotFound):
            endpoints.set_endpoint_key(s, as_bob, api.clock, second["endpoint"], "k" * 32)


def test_a_long_lived_cli_token_dies_with_a_rotated_secret(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The token ``up`` writes for the CLI outlives a login's 12 h, and still stops working
    when ``heteroflow rotate-jwt-secret`` runs."""
    monkeypatch.setenv("HETEROFLOW_DATABASE_URL", api.app.settings.resolved_database_url())
    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(api.app.settings.data_dir))
    monkeypatch.delenv("HETEROFLOW_JWT_SECRET", raising=False)
    with api.app.db.session() as s:
        admin = s.scalar(select(User).where(User.username == "admin"))
        assert admin is not None
        long = api.app.ctx.tokens.issue(admin, ttl_s=up.CLI_TOKEN_TTL_S)
    short = api.login()
    api.clock.advance(api.app.settings.jwt_ttl_s + 60)
    assert api.client.get(PROTECTED, headers=short).status_code == 401
    bearer = {"Authorization": f"Bearer {long}"}
    assert api.client.get(PROTECTED, headers=bearer).status_code == 200
    assert cli.main(["rotate-jwt-secret"]) == 0
    api.clock.advance(api.app.settings.jwt_secret_cache_s + 1)
    assert api.client.get(PROTECTED, headers=bearer).status_code == 401


def test_the_demo_key_file_is_owner_only_and_kept(tmp_path: Path) -> None:
    key = up.demo_key(tmp_path)
    path = tmp_path / up.DEMO_KEY_FILE
    assert path.stat().st_mode & 0o777 == 0o600
    assert key.startswith("sk-") and up.demo_key(tmp_path) == key
    path.chmod(0o644)  # loosened by hand: made owner-only again, the key kept
    assert up.demo_key(tmp_path) == key and path.stat().st_mode & 0o777 == 0o600
    path.write_text("mine-" + "z" * 30 + "\n")  # a key of the owner's choosing is used
    assert up.demo_key(tmp_path) == "mine-" + "z" * 30
    path.write_text("not a key\n")  # anything else is replaced
    fresh = up.demo_key(tmp_path)
    assert fresh.startswith("sk-") and path.read_text().strip() == fresh


def test_up_logs_the_cli_in_but_never_over_another_servers_login(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HETEROFLOW_CLI_DIR", str(tmp_path / "cli"))
    state = tmp_path / "cli" / "cli.json"
    base = "http://127.0.0.1:3333"

    line = up_cli.login_cli(api.app, base, "heteroflow")  # no login yet: admin's
    assert "logged in as admin" in line
    saved = json.loads(state.read_text())
    assert saved["server"] == base and state.stat().st_mode & 0o777 == 0o600
    bearer = {"Authorization": f"Bearer {saved['token']}"}
    assert api.client.get(PROTECTED, headers=bearer).status_code == 200

    # the next `up` on another port: its own login follows it to the new address
    assert "logged in as admin" in up_cli.login_cli(api.app, "http://127.0.0.1:4444", "heteroflow")
    assert json.loads(state.read_text()) == {**saved, "server": "http://127.0.0.1:4444"}

    # another server's login is left alone, and the line says how to log in here
    other = {"server": "http://10.1.2.3:3333", "token": "someone-elses-token"}
    state.write_text(json.dumps(other))
    line = up_cli.login_cli(api.app, base, "heteroflow")
    assert "another server (http://10.1.2.3:3333)" in line
    assert f"heteroflow login --server {base}" in line
    assert json.loads(state.read_text()) == other

    # a dead login to this very address is replaced
    state.write_text(json.dumps({"server": base, "token": "expired-or-revoked"}))
    assert "logged in as admin" in up_cli.login_cli(api.app, base, "heteroflow")
    assert json.loads(state.read_text())["token"] != "expired-or-revoked"


def test_the_management_hints_name_user_password_login_and_docs(tmp_path: Path) -> None:
    base = "http://127.0.0.1:3333"
    first = up_cli.management_hints(base, tmp_path, "heteroflow", "CLI: …", password_shown=True)
    later = up_cli.management_hints(base, tmp_path, "heteroflow", "CLI: …", password_shown=False)
    for text in (first, later):
        assert f"{base}/api/v1/docs" in text and "admin user: admin" in text
        assert f"Web console: {base}/" in text
        assert f"heteroflow login --server {base}" in text
        # reset-password finds the database through the environment, as the server does
        assert f"HETEROFLOW_DATA_DIR={tmp_path} heteroflow reset-password admin" in text
    assert "printed above" in first and "the one from the first start" in later


def test_making_a_demo_model_says_what_it_makes_and_how_long_it_took(tmp_path: Path) -> None:
    said: list[str] = []
    path = ensure_demo_model(tmp_path, "tiny", progress=said.append)
    assert path.is_file()
    assert said[0].startswith("generating the tiny demo model") and said[0].endswith("…")
    assert re.fullmatch(r"  done: \d+ KB in \d+\.\d s", said[1]), said
    said.clear()
    ensure_demo_model(tmp_path, "tiny", progress=said.append)
    assert said == []  # nothing to say when it is there already
