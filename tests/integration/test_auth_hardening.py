"""Authentication hardening (issue 10, item 5), written as attacks on a real server.

Login throttling per user name and per client address, the same scrypt cost for
unknown and known users, strict token validation against the database, revocation by
``tokens_valid_after`` and by rotating the JWT secret. Every test runs on SQLite and
PostgreSQL.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import jwt
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from heteroflow.core.errors import Unauthorized
from heteroflow.db.tables import LoginThrottle, PlatformSetting, Tenant, User
from heteroflow.services.identity.auth import (
    JWT_SECRET_KEY,
    Tokens,
    rotate_jwt_secret,
    shared_secret,
)

from .conftest import ADMIN_PASSWORD, Api

LOGIN = "/api/v1/auth/login"
PROTECTED = "/api/v1/task-groups"


def _login(client: TestClient, username: str, password: str) -> Any:
    return client.post(LOGIN, json={"username": username, "password": password})


def _from(api: Api, address: str) -> TestClient:
    """A client at another address (same app; no second lifespan)."""
    return TestClient(api.app.asgi, client=(address, 40000))


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _secret(api: Api) -> str:
    with api.app.db.session() as s:
        row = s.get(PlatformSetting, JWT_SECRET_KEY)
        assert row is not None
        return row.value


def _user(api: Api, username: str) -> User:
    with api.app.db.session() as s:
        u = s.scalar(select(User).where(User.username == username))
        assert u is not None
        return u


def _claims(api: Api, username: str = "admin") -> dict[str, Any]:
    """Valid claims for ``username``, as a login would issue them now."""
    u = _user(api, username)
    now = int(api.clock.now().timestamp())
    return {
        "sub": u.id,
        "name": u.username,
        "tenant": u.tenant_id,
        "role": u.role,
        "iat": now,
        "exp": now + 3600,
    }


def _forge(api: Api, claims: dict[str, Any]) -> dict[str, str]:
    """Signed with the real secret from the database: only the claims are odd."""
    return _bearer(jwt.encode(claims, _secret(api), algorithm="HS256"))


def _assert_401(r: Any) -> None:  # httpx's or the TestClient's (httpx2) response
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "unauthorized"


@pytest.fixture
def scrypt_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """How many times scrypt ran (not how long anything took)."""
    calls: list[int] = []
    real: Callable[..., bytes] = hashlib.scrypt

    def counting(*args: Any, **kwargs: Any) -> bytes:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(hashlib, "scrypt", counting)
    yield calls


# ---- throttling ----


def test_thirty_wrong_passwords_then_the_right_one_is_refused_until_the_back_off_ends(
    api: Api, scrypt_calls: list[int]
) -> None:
    answers = [_login(api.client, "admin", f"guess-{i}").status_code for i in range(30)]
    assert answers == [401] * 5 + [429] * 25
    assert len(scrypt_calls) == 5  # blocked attempts never reach the password check

    r = _login(api.client, "admin", ADMIN_PASSWORD)  # even the right password
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "too_many_requests"
    assert set(r.json()["error"]) == {"code", "message", "field"}
    wait = int(r.headers["Retry-After"])
    assert wait == int(api.app.settings.login_backoff_base_s)  # 5 failures: base * 2^0
    assert len(scrypt_calls) == 5

    api.clock.advance(wait - 0.5)
    assert _login(api.client, "admin", ADMIN_PASSWORD).status_code == 429
    api.clock.advance(0.5)
    r = _login(api.client, "admin", ADMIN_PASSWORD)
    assert r.status_code == 200, r.text
    assert api.client.get(PROTECTED, headers=_bearer(r.json()["access_token"])).status_code == 200


def test_each_further_failure_doubles_the_block(api: Api) -> None:
    for i in range(5):
        assert _login(api.client, "admin", f"guess-{i}").status_code == 401
    for failures, block in ((6, 2), (7, 4), (8, 8)):
        api.clock.advance(block / 2)  # the previous block (half this one) is over
        assert _login(api.client, "admin", f"guess-{failures}").status_code == 401
        r = _login(api.client, "admin", ADMIN_PASSWORD)
        assert r.status_code == 429 and r.headers["Retry-After"] == str(block)
    # the counter is shared through the database: every instance sees the same rows
    with api.app.db.session() as s:
        row = s.get(LoginThrottle, "user:admin")
        assert row is not None and row.failures == 8


def test_a_parallel_burst_gets_five_password_checks_not_one_per_request(
    api: Api, scrypt_calls: list[int]
) -> None:
    """Attempts in flight together must not all be checked before a failure is written."""
    with ThreadPoolExecutor(max_workers=16) as pool:
        answers = list(
            pool.map(lambda i: _login(api.client, "admin", f"burst-{i}").status_code, range(24))
        )
    assert sorted(answers) == [401] * 5 + [429] * 19
    assert len(scrypt_calls) == 5


def test_one_address_is_blocked_across_user_names(api: Api) -> None:
    admin = api.login()
    api.member(admin, "team-a", "alice")
    sprayer = _from(api, "203.0.113.7")
    for name in ("bob", "carol", "dave", "erin", "frank"):  # one guess per (unknown) name
        assert _login(sprayer, name, "Summer2026!").status_code == 401
    # a sixth name from that address, even with the right password: refused
    r = _login(sprayer, "alice", "member-pass-1")
    assert r.status_code == 429 and "Retry-After" in r.headers
    # alice herself, from her own address, is not affected
    assert _login(_from(api, "198.51.100.2"), "alice", "member-pass-1").status_code == 200


def test_one_user_is_blocked_across_addresses(api: Api) -> None:
    for i in range(5):  # a botnet: every guess from another address
        assert _login(_from(api, f"192.0.2.{i + 1}"), "admin", f"guess-{i}").status_code == 401
    r = _login(_from(api, "192.0.2.200"), "admin", ADMIN_PASSWORD)
    assert r.status_code == 429, r.text


def test_unknown_names_are_throttled_like_known_ones(api: Api) -> None:
    """Throttling must not tell which names exist."""
    known = [_login(_from(api, "192.0.2.1"), "admin", f"g{i}").status_code for i in range(6)]
    unknown = [_login(_from(api, "192.0.2.2"), "nobody", f"g{i}").status_code for i in range(6)]
    assert known == unknown == [401] * 5 + [429]


def test_a_success_clears_the_counters_of_that_user_and_address(api: Api) -> None:
    for i in range(4):
        assert _login(api.client, "admin", f"guess-{i}").status_code == 401
    assert _login(api.client, "admin", ADMIN_PASSWORD).status_code == 200
    for i in range(4):  # four more are free again
        assert _login(api.client, "admin", f"again-{i}").status_code == 401
    assert _login(api.client, "admin", ADMIN_PASSWORD).status_code == 200


def test_a_quiet_key_counts_from_zero_again(api: Api) -> None:
    for i in range(5):
        assert _login(api.client, "admin", f"guess-{i}").status_code == 401
    api.clock.advance(api.app.settings.login_throttle_forget_s)
    # one more failure is the first of a new count, not the sixth: no block follows it
    assert _login(api.client, "admin", "late-guess").status_code == 401
    assert _login(api.client, "admin", ADMIN_PASSWORD).status_code == 200


# ---- the same cost for unknown and known users ----


def test_unknown_and_known_users_both_run_scrypt(api: Api, scrypt_calls: list[int]) -> None:
    unknown = _login(api.client, "no-such-user", "whatever-1")
    assert len(scrypt_calls) == 1
    known = _login(api.client, "admin", "whatever-1")
    assert len(scrypt_calls) == 2
    assert _login(api.client, "admin", ADMIN_PASSWORD).status_code == 200
    assert len(scrypt_calls) == 3
    # and the answers cannot be told apart either
    assert unknown.status_code == known.status_code == 401
    assert unknown.json() == known.json()


# ---- strict tokens ----

BAD_CLAIMS: dict[str, Callable[[dict[str, Any]], object]] = {
    "missing sub": lambda d: d.pop("sub"),
    "missing name": lambda d: d.pop("name"),
    "missing tenant": lambda d: d.pop("tenant"),
    "missing role": lambda d: d.pop("role"),
    "missing iat": lambda d: d.pop("iat"),
    "missing exp": lambda d: d.pop("exp"),
    "exp soon": lambda d: d.update(exp="soon"),
    "exp true": lambda d: d.update(exp=True),
    "exp float": lambda d: d.update(exp=float(d["exp"])),
    "exp as text digits": lambda d: d.update(exp=str(d["exp"])),
    "iat now": lambda d: d.update(iat="now"),
    "iat false": lambda d: d.update(iat=False),
    "exp past": lambda d: d.update(exp=d["iat"] - 1),
    "role root": lambda d: d.update(role="root"),
    "role null": lambda d: d.update(role=None),
    "tenant number": lambda d: d.update(tenant=7),
    "tenant list": lambda d: d.update(tenant=["tn-x"]),
    "name empty": lambda d: d.update(name=""),
    "unknown sub": lambda d: d.update(sub="usr-000000000000"),
    "other name": lambda d: d.update(name="mallory"),
    "other tenant": lambda d: d.update(tenant="tn-000000000000"),
    "member claims operator": lambda d: d.update(role="member"),
}


@pytest.mark.feature("N1")
@pytest.mark.parametrize("case", sorted(BAD_CLAIMS))
def test_validly_signed_tokens_with_bad_claims_are_401(api: Api, case: str) -> None:
    claims = _claims(api)
    # the untouched claims pass: only the change below makes the token fail
    assert api.client.get(PROTECTED, headers=_forge(api, claims)).status_code == 200
    BAD_CLAIMS[case](claims)
    headers = _forge(api, claims)
    _assert_401(api.client.get(PROTECTED, headers=headers))
    # the gateway's route checks tokens the same way
    _assert_401(api.client.get("/api/v1/gateway/snapshot", headers=headers))


@pytest.mark.feature("N1")
def test_a_token_of_a_deleted_user_is_401(api: Api) -> None:
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    assert api.client.get(PROTECTED, headers=alice).status_code == 200
    with api.app.db.session() as s:
        u = s.scalar(select(User).where(User.username == "alice"))
        assert u is not None
        s.delete(u)
    _assert_401(api.client.get(PROTECTED, headers=alice))


@pytest.mark.feature("N1")
def test_a_token_of_a_user_whose_role_or_tenant_changed_is_401(api: Api) -> None:
    admin = api.login()
    alice = api.member(admin, "team-a", "alice")
    with api.app.db.session() as s:
        u = s.scalar(select(User).where(User.username == "alice"))
        assert u is not None
        u.role = "operator"  # promoted: the old member token does not become operator
    _assert_401(api.client.get(PROTECTED, headers=alice))
    with api.app.db.session() as s:
        u = s.scalar(select(User).where(User.username == "admin"))
        assert u is not None
        u.role = "member"  # demoted: the operator token stops working at once
    _assert_401(api.client.get("/api/v1/tenants", headers=admin))
    with api.app.db.session() as s:
        u = s.scalar(select(User).where(User.username == "alice"))
        other = s.scalar(select(Tenant).where(Tenant.name == "default"))
        assert u is not None and other is not None
        u.role = "member"
        u.tenant_id = other.id  # moved to another tenant
    _assert_401(api.client.get(PROTECTED, headers=alice))
    assert api.client.get(PROTECTED, headers=api.login("alice", "member-pass-1")).status_code == 200


@pytest.mark.feature("N1")
def test_tokens_issued_before_tokens_valid_after_are_401(api: Api) -> None:
    old = api.login()
    api.clock.advance(30)
    with api.app.db.session() as s:
        u = s.scalar(select(User).where(User.username == "admin"))
        assert u is not None
        u.tokens_valid_after = api.clock.now()
    _assert_401(api.client.get(PROTECTED, headers=old))
    # a forged token dated just before the cut-off is refused as well
    claims = _claims(api)
    claims["iat"] -= 1
    _assert_401(api.client.get(PROTECTED, headers=_forge(api, claims)))
    # a login in the very second of the revocation works (stamped with the next second)
    fresh = api.login()
    assert api.client.get(PROTECTED, headers=fresh).status_code == 200


@pytest.mark.feature("N1")
def test_rotating_the_secret_revokes_every_token_and_a_fresh_login_works(api: Api) -> None:
    admin = api.login()
    api.member(admin, "team-a", "alice")
    alice = api.login("alice", "member-pass-1")
    rotate_jwt_secret(api.app.db)
    api.clock.advance(api.app.settings.jwt_secret_cache_s)  # every instance re-reads it
    _assert_401(api.client.get(PROTECTED, headers=admin))
    _assert_401(api.client.get(PROTECTED, headers=alice))
    assert api.client.get(PROTECTED, headers=api.login()).status_code == 200


@pytest.mark.feature("N1")
def test_another_instance_accepts_a_token_signed_with_the_rotated_secret(api: Api) -> None:
    """Instance B still holds the old secret when A, after a rotation, issues a token:
    B re-reads the secret on the mismatch instead of refusing for a whole cache time."""
    db = api.app.db
    other = Tokens(
        partial(shared_secret, db, JWT_SECRET_KEY), 3600, api.clock, secret_cache_s=60.0
    )
    before = api.login()["Authorization"][7:]
    assert other.decode(before).name == "admin"
    rotate_jwt_secret(db)
    after = api.login()["Authorization"][7:]  # issuing always reads the current secret
    api.clock.advance(0.25)  # far less than B's cache time
    assert other.decode(after).name == "admin"
    with pytest.raises(Unauthorized, match="invalid token"):
        other.decode(before)


def test_a_throttle_row_is_written_for_each_key(api: Api) -> None:
    """The rows other instances read: one per user name and one per address."""
    assert _login(_from(api, "192.0.2.9"), "nobody", "x").status_code == 401
    with api.app.db.session() as s:
        keys = set(s.scalars(select(LoginThrottle.key)))
    assert keys == {"user:nobody", "addr:192.0.2.9"}
