"""Users' JWTs and the principal every management call acts as.

Strict token checks against the database (``authenticate``), revocation for everyone
(``rotate_jwt_secret``; per user: ``login.reset_password`` ->
``users.tokens_valid_after``), the cluster-wide secrets every instance shares, and the
first admin. Passwords: ``passwords``; login and its throttle: ``login``; the agents'
node token: ``node_tokens``.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import jwt
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from heteroflow.core.auth_policy import first_valid_iat
from heteroflow.core.clock import Clock
from heteroflow.core.errors import Unauthorized
from heteroflow.core.ids import new_id
from heteroflow.db.engine import Database
from heteroflow.db.tables import PlatformSetting, Tenant, User
from heteroflow.services.identity.passwords import hash_password

log = logging.getLogger(__name__)

OPERATOR = "operator"
MEMBER = "member"
# a member who also manages tenant-level settings of their own tenant (today: its
# registry credentials, H7); everywhere else a member
TENANT_ADMIN = "tenant_admin"
DEFAULT_TENANT = "default"
ROLES = frozenset({OPERATOR, MEMBER, TENANT_ADMIN})
JWT_SECRET_KEY = "jwt_secret"  # noqa: S105 - the platform_settings row that holds it


@dataclass(frozen=True, slots=True)
class Principal:
    user_id: str
    username: str
    tenant_id: str
    role: str
    # N5: a member of a tenant with ``members_see_own`` sees only what they created
    # (services/identity/access.py); never an operator
    own_only: bool = False

    @property
    def is_operator(self) -> bool:
        return self.role == OPERATOR

    @property
    def is_tenant_admin(self) -> bool:
        return self.role == TENANT_ADMIN


def shared_secret(db: Database, key: str, preset: str = "") -> str:
    """A cluster-wide secret kept in the database so every server instance agrees on it.

    ``preset`` (from the environment) wins; otherwise the first instance generates one.
    """
    if preset:
        return preset
    with db.session() as s:
        row = s.get(PlatformSetting, key)
        if row is not None:
            return row.value
    try:
        with db.session() as s:
            s.add(PlatformSetting(key=key, value=secrets.token_urlsafe(32)))
    except IntegrityError:
        pass  # another instance won the race; read its value below
    with db.session() as s:
        row = s.get(PlatformSetting, key)
        assert row is not None
        return row.value


def rotate_jwt_secret(db: Database) -> None:
    """A new random JWT secret: every token issued so far stops working.

    Server instances re-read the secret within ``jwt_secret_cache_s``. An instance whose
    secret is preset from the environment (HETEROFLOW_JWT_SECRET) does not read it.
    """
    value = secrets.token_urlsafe(32)
    with db.session() as s:
        row = s.get(PlatformSetting, JWT_SECRET_KEY)
        if row is None:
            s.add(PlatformSetting(key=JWT_SECRET_KEY, value=value))
        else:
            row.value = value
    log.warning("the JWT secret was rotated: every issued token is now invalid")


@dataclass(frozen=True, slots=True)
class Bootstrap:
    admin_password_generated: str | None  # printed once to the operator's terminal


def bootstrap(db: Database, clock: Clock, admin_password: str) -> Bootstrap:
    """At first start: the default tenant and the ``admin`` platform operator."""
    generated: str | None = None
    with db.session() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == DEFAULT_TENANT))
        if tenant is None:
            tenant = Tenant(id=new_id("tn"), name=DEFAULT_TENANT, created_at=clock.now())
            s.add(tenant)
            s.flush()
        if s.scalar(select(User).where(User.username == "admin")) is None:
            password = admin_password
            if not password:
                password = generated = secrets.token_urlsafe(12)
            s.add(
                User(
                    id=new_id("usr"),
                    username="admin",
                    password_hash=hash_password(password),
                    role=OPERATOR,
                    tenant_id=tenant.id,
                    created_at=clock.now(),
                )
            )
    return Bootstrap(admin_password_generated=generated)


@dataclass(frozen=True, slots=True)
class TokenClaims:
    """A token's claims after the signature, every type and the expiry were checked."""

    sub: str
    name: str
    tenant: str
    role: str
    iat: int
    exp: int


_REQUIRED_CLAIMS = ("sub", "name", "tenant", "role", "iat", "exp")
# A copy of a stored secret older than this is re-read when a signature does not match
# (another instance may already sign with a rotated secret); bounds those reads. The
# node token check (node_tokens.NodeTokens) re-reads its stored tokens the same way.
RECHECK_S = 0.25


class Tokens:
    """Issues and checks the management API's JWTs (HS256).

    ``secret`` is a fixed value (preset from the environment) or a loader of the value
    stored in the database; a loaded copy is trusted for ``secret_cache_s``, so a
    rotation reaches every instance within that time. Issuing always re-reads it.
    """

    def __init__(
        self,
        secret: str | Callable[[], str],
        ttl_s: float,
        clock: Clock,
        *,
        secret_cache_s: float = 2.0,
    ) -> None:
        self._ttl = ttl_s
        self._clock = clock
        self._cache_s = secret_cache_s
        self._load: Callable[[], str] | None = None
        if isinstance(secret, str):
            self._cached = (secret, clock.monotonic())
        else:
            self._load = secret
            self._cached = (secret(), clock.monotonic())

    def _secret(self, *, older_than_s: float | None = None) -> str:
        value, loaded_at = self._cached  # one tuple: threads never see half an update
        if self._load is None:
            return value
        limit = self._cache_s if older_than_s is None else older_than_s
        now = self._clock.monotonic()
        if now - loaded_at >= limit:
            value = self._load()
            self._cached = (value, now)
        return value

    def issue(self, user: User, *, ttl_s: float | None = None) -> str:
        """A token for ``user``, valid for ``ttl_s`` (default: this instance's TTL).

        Whatever its lifetime, a token stops working when the secret is rotated or the
        user's tokens are revoked (``authenticate``). ``heteroflow up`` asks for a long
        one for the CLI state file it writes.
        """
        now: datetime = self._clock.now()
        issued = math.floor(now.timestamp())
        claims = {
            "sub": user.id,
            "name": user.username,
            "tenant": user.tenant_id,
            "role": user.role,
            # a login in the second of a revocation is stamped with the next second
            "iat": max(issued, first_valid_iat(user.tokens_valid_after)),
            "exp": math.floor(
                (now + timedelta(seconds=self._ttl if ttl_s is None else ttl_s)).timestamp()
            ),
        }
        return jwt.encode(claims, self._secret(older_than_s=0.0), algorithm="HS256")

    def _decode(self, token: str, secret: str) -> dict[str, Any]:
        claims: dict[str, Any] = jwt.decode(
            token,
            secret,
            algorithms=["HS256"],
            # times are checked below against the injected clock, not by PyJWT
            options={
                "require": list(_REQUIRED_CLAIMS),
                "verify_exp": False,
                "verify_iat": False,
                "verify_nbf": False,
            },
        )
        return claims

    def decode(self, token: str) -> TokenClaims:
        """Signature, required claims and their types, role, expiry; else Unauthorized.

        This does not look at the database: ``authenticate`` does, and is what callers
        use.
        """
        try:
            try:
                claims = self._decode(token, self._secret())
            except jwt.InvalidSignatureError:
                if self._load is None:
                    raise
                claims = self._decode(token, self._secret(older_than_s=RECHECK_S))
        except (jwt.PyJWTError, ValueError, TypeError) as exc:
            raise Unauthorized("invalid token") from exc
        c = TokenClaims(
            sub=_str_claim(claims, "sub"),
            name=_str_claim(claims, "name"),
            tenant=_str_claim(claims, "tenant"),
            role=_str_claim(claims, "role"),
            iat=_int_claim(claims, "iat"),
            exp=_int_claim(claims, "exp"),
        )
        if c.role not in ROLES:
            raise Unauthorized("invalid token: claim 'role'")
        if c.exp < math.floor(self._clock.now().timestamp()):
            raise Unauthorized("token expired")
        return c


def _str_claim(claims: dict[str, Any], name: str) -> str:
    value = claims.get(name)
    if not isinstance(value, str) or not value:
        raise Unauthorized(f"invalid token: claim '{name}'")
    return value


def _int_claim(claims: dict[str, Any], name: str) -> int:
    value = claims.get(name)
    if type(value) is not int:  # not bool, not float, not "soon"
        raise Unauthorized(f"invalid token: claim '{name}'")
    return value


def authenticate(s: Session, tokens: Tokens, token: str) -> Principal:
    """Who a bearer token speaks for, or Unauthorized.

    Besides the token itself: the user must still exist with the token's name, role and
    tenant, and the token must not predate the user's ``tokens_valid_after``. One query
    reads the user and their tenant's ``members_see_own`` (``Principal.own_only``), so a
    change of that switch applies from the next request.
    """
    c = tokens.decode(token)
    row = s.execute(
        select(User, Tenant.members_see_own)
        .join(Tenant, Tenant.id == User.tenant_id)
        .where(User.id == c.sub)
    ).one_or_none()
    user = row[0] if row is not None else None
    if user is None or (user.username, user.tenant_id, user.role) != (c.name, c.tenant, c.role):
        raise Unauthorized("token no longer valid: log in again")
    if c.iat < first_valid_iat(user.tokens_valid_after):
        raise Unauthorized("token revoked: log in again")
    assert row is not None
    return Principal(
        user_id=user.id, username=user.username, tenant_id=user.tenant_id, role=user.role,
        own_only=user.role != OPERATOR and bool(row[1]),
    )
