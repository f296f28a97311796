"""`heteroflow rotate-jwt-secret` and `heteroflow reset-password` against the database of
a running (in-process) server, on SQLite and PostgreSQL."""

from __future__ import annotations

import getpass
import io
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from heteroflow import cli
from heteroflow.core import clock as clock_module

from .conftest import ADMIN_PASSWORD, Api

PROTECTED = "/api/v1/task-groups"


@pytest.fixture
def server_env(api: Api, monkeypatch: pytest.MonkeyPatch) -> Api:
    """The CLI sees the server's database, as an operator's shell would; its clock is the
    server's fake clock (so the reset moment and the tokens agree)."""
    monkeypatch.setenv("HETEROFLOW_DATABASE_URL", api.app.settings.resolved_database_url())
    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(api.app.settings.data_dir))
    monkeypatch.delenv("HETEROFLOW_JWT_SECRET", raising=False)
    monkeypatch.setattr(clock_module, "SystemClock", lambda: api.clock)
    return api


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stdin(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(text))  # not a TTY


def _secret_row(api: Api) -> str:
    from heteroflow.db.tables import PlatformSetting
    from heteroflow.services.identity.auth import JWT_SECRET_KEY

    with api.app.db.session() as s:
        row = s.get(PlatformSetting, JWT_SECRET_KEY)
        assert row is not None
        return row.value


@pytest.mark.feature("N1")
def test_rotate_jwt_secret_revokes_old_tokens_and_prints_no_secret(
    server_env: Api, capsys: pytest.CaptureFixture[str]
) -> None:
    api = server_env
    old = api.login()
    before = _secret_row(api)
    assert cli.main(["rotate-jwt-secret"]) == 0
    after = _secret_row(api)
    out, err = capsys.readouterr()
    assert after != before
    assert "invalid" in out
    assert after not in out + err and before not in out + err
    api.clock.advance(api.app.settings.jwt_secret_cache_s)
    assert api.client.get(PROTECTED, headers=old).status_code == 401
    assert api.client.get(PROTECTED, headers=api.login()).status_code == 200


def test_rotate_jwt_secret_refuses_a_secret_preset_in_the_environment(
    server_env: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _secret_row(server_env)
    monkeypatch.setenv("HETEROFLOW_JWT_SECRET", "from-the-environment")
    assert cli.main(["rotate-jwt-secret"]) == 2
    out, err = capsys.readouterr()
    assert "HETEROFLOW_JWT_SECRET" in err and "from-the-environment" not in out + err
    assert _secret_row(server_env) == before


@pytest.mark.feature("N1")
def test_reset_password_revokes_the_users_tokens_and_the_new_password_logs_in(
    server_env: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    api = server_env
    admin = api.login()
    api.member(admin, "team-a", "alice")
    alice = api.login("alice", "member-pass-1")
    _stdin(monkeypatch, "brand-new-pass-7\n")
    assert cli.main(["reset-password", "alice"]) == 0
    out, err = capsys.readouterr()
    assert "brand-new-pass-7" not in out + err and "alice" in out

    assert api.client.get(PROTECTED, headers=alice).status_code == 401
    assert api.client.get(PROTECTED, headers=admin).status_code == 200  # only alice's
    r = api.client.post(
        "/api/v1/auth/login", json={"username": "alice", "password": "member-pass-1"}
    )
    assert r.status_code == 401
    # a login in the same second as the reset already works
    fresh = api.login("alice", "brand-new-pass-7")
    assert api.client.get(PROTECTED, headers=fresh).status_code == 200


def test_reset_password_unlocks_a_throttled_user(
    server_env: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = server_env
    for i in range(6):
        api.client.post("/api/v1/auth/login", json={"username": "admin", "password": f"g{i}"})
    other = {"username": "admin", "password": ADMIN_PASSWORD}
    assert api.client.post("/api/v1/auth/login", json=other).status_code == 429
    _stdin(monkeypatch, "--password-stdin-is-fine\n")
    assert cli.main(["reset-password", "--password-stdin", "admin"]) == 0
    # the user name is unlocked at once (the attacker's address stays blocked)
    elsewhere = TestClient(api.app.asgi, client=("198.51.100.9", 40000))
    new = {"username": "admin", "password": "--password-stdin-is-fine"}
    assert elsewhere.post("/api/v1/auth/login", json=new).status_code == 200
    assert api.client.post("/api/v1/auth/login", json=new).status_code == 429


def test_reset_password_of_an_unknown_user_exits_1(
    server_env: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, "whatever-pass-1\n")
    assert cli.main(["reset-password", "nobody"]) == 1
    out, err = capsys.readouterr()
    assert "no user named 'nobody'" in err and "whatever-pass-1" not in out + err


def test_reset_password_refuses_a_short_or_empty_password(
    server_env: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stdin(monkeypatch, "short\n")
    assert cli.main(["reset-password", "--password-stdin", "admin"]) == 2
    _stdin(monkeypatch, "")
    assert cli.main(["reset-password", "admin"]) == 2
    assert "short" not in capsys.readouterr().out
    assert server_env.login()  # the old password still works


def test_reset_password_prompts_twice_on_a_terminal(
    server_env: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", _Terminal(""))
    answers = iter(["typed-pass-123", "typed-pass-124"])
    monkeypatch.setattr(getpass, "getpass", lambda prompt="": next(answers))
    assert cli.main(["reset-password", "admin"]) == 2  # the two differ: nothing changes
    assert server_env.login()
    answers = iter(["typed-pass-123", "typed-pass-123"])
    assert cli.main(["reset-password", "admin"]) == 0
    assert server_env.login("admin", "typed-pass-123")


def test_the_cli_does_not_create_a_missing_sqlite_database(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("HETEROFLOW_DATABASE_URL", raising=False)
    monkeypatch.delenv("HETEROFLOW_JWT_SECRET", raising=False)
    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(tmp_path))
    assert cli.main(["rotate-jwt-secret"]) == 1
    assert "no database at" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
