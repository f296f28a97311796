"""Users, passwords, JWTs and the principal every management call acts as.

Login throttling (its rule: core/auth_policy.py), strict token checks against the
database (``authenticate``), revocation per user (``reset_password`` ->
``users.tokens_valid_after``) and for everyone (``rotate_jwt_secret``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import jwt
from sqlalchemy import case, delete, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from heteroflow.core.auth_policy import LoginBackoff, first_valid_iat, retry_after_s
from heteroflow.core.clock import Clock
from heteroflow.core.errors import NotFound, TooManyRequests, Unauthorized, ValidationFailed
from heteroflow.core.ids import new_id
from heteroflow.db.engine import Database
from heteroflow.db.tables import LoginThrottle, PlatformSetting, Tenant, User

log = logging.getLogger(__name__)

OPERATOR = "operator"
MEMBER = "member"
DEFAULT_TENANT = "default"
ROLES = frozenset({OPERATOR, MEMBER})
JWT_SECRET_KEY = "jwt_secret"  # noqa: S105 - the platform_settings row that holds it
MIN_PASSWORD_LENGTH = 8  # as UserCreate
MAX_PASSWORD_LENGTH = 1024
_SCRYPT = {"n": 2**14, "r": 8, "p": 1}
# Checked when the user does not exist, so an unknown name costs the same scrypt as a
# known one (no user enumeration by timing). Random bytes: no password matches it.
_DUMMY_HASH = (
    "scrypt$NovHz12okk5GalNGE5ro3A==$+o4z8LfWua9QX82+6QqJfEAtfsrwXmotG8aPjoFG9SXKQSK3Vu6u"
    "hYtU0Heq5ikGr4SyEsMUUEMDrmyjDPRhvA=="
)


@dataclass(frozen=True, slots=True)
class Principal:
    user_id: str
    username: str
    tenant_id: str
    role: str

    @property
    def is_operator(self) -> bool:
        return self.role == OPERATOR


def hash_password(password: str) -> str:
    salt = secrets.token_bytes(16)
    digest = hashlib.scrypt(password.encode(), salt=salt, **_SCRYPT)
    return "scrypt$" + base64.b64encode(salt).decode() + "$" + base64.b64encode(digest).decode()


def verify_password(password: str, stored: str) -> bool:
    try:
        scheme, salt_b64, digest_b64 = stored.split("$")
    except ValueError:
        return False
    if scheme != "scrypt":
        return False
    digest = hashlib.scrypt(password.encode(), salt=base64.b64decode(salt_b64), **_SCRYPT)
    return hmac.compare_digest(digest, base64.b64decode(digest_b64))


def check_password(user: User | None, password: str) -> bool:
    """The password check, at the same cost whether or not the user exists."""
    ok = verify_password(password, user.password_hash if user is not None else _DUMMY_HASH)
    return ok and user is not None


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


def reset_password(db: Database, clock: Clock, username: str, password: str) -> None:
    """Set a user's password; the user's existing tokens stop working.

    Also clears the throttle of that user name (an operator's reset unlocks it).
    """
    if not MIN_PASSWORD_LENGTH <= len(password) <= MAX_PASSWORD_LENGTH:
        raise ValidationFailed(
            f"a password has {MIN_PASSWORD_LENGTH} to {MAX_PASSWORD_LENGTH} characters",
            field="password",
        )
    with db.session() as s:
        user = s.scalar(select(User).where(User.username == username))
        if user is None:
            raise NotFound(f"no user named {username!r}", field="username")
        user.password_hash = hash_password(password)
        user.tokens_valid_after = clock.now()
        s.execute(delete(LoginThrottle).where(LoginThrottle.key == user_key(username)))
    log.info("password of user %s reset; their earlier tokens are revoked", username)


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
# (another instance may already sign with a rotated secret); bounds those reads.
_RECHECK_S = 0.25


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
                claims = self._decode(token, self._secret(older_than_s=_RECHECK_S))
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
    tenant, and the token must not predate the user's ``tokens_valid_after``.
    """
    c = tokens.decode(token)
    user = s.get(User, c.sub)
    if user is None or (user.username, user.tenant_id, user.role) != (c.name, c.tenant, c.role):
        raise Unauthorized("token no longer valid: log in again")
    if c.iat < first_valid_iat(user.tokens_valid_after):
        raise Unauthorized("token revoked: log in again")
    return Principal(
        user_id=user.id, username=user.username, tenant_id=user.tenant_id, role=user.role
    )


# ---- login and its throttle (the rule: core/auth_policy.py) ----


def user_key(username: str) -> str:
    return f"user:{username}"


def address_key(address: str) -> str:
    return f"addr:{address or 'unknown'}"[:200]


def login(
    db: Database,
    tokens: Tokens,
    clock: Clock,
    backoff: LoginBackoff,
    username: str,
    password: str,
    address: str,
) -> str:
    """A token for the right password, unless the user name or the address is blocked.

    Blocked: TooManyRequests (Retry-After), and the password is not checked. Otherwise
    the attempt is counted against both keys *before* the password is checked, so
    attempts sent in parallel cannot all be checked before the first failure is
    written; a success removes both counts (see core/auth_policy.py).
    """
    now = clock.now()
    keys = (user_key(username), address_key(address))
    with db.session() as s:
        blocked = [
            b
            for b in s.scalars(
                select(LoginThrottle.blocked_until).where(
                    LoginThrottle.key.in_(keys), LoginThrottle.blocked_until > now
                )
            )
            if b is not None
        ]
    for key in keys:
        if blocked:
            break
        until = _admit(db, key, now, backoff)
        if until is not None:
            blocked.append(until)  # blocked since the read above (another attempt)
    if blocked:
        wait = retry_after_s(max(blocked), now)
        raise TooManyRequests(f"too many failed logins: try again in {wait} s", retry_after_s=wait)
    with db.session() as s:
        user = s.scalar(select(User).where(User.username == username))
    # outside the session: scrypt holds no database connection
    if not check_password(user, password):
        _forget_quiet_keys(db, now, backoff)
        raise Unauthorized("wrong username or password")
    assert user is not None
    token = tokens.issue(user)
    with db.session() as s:
        s.execute(delete(LoginThrottle).where(LoginThrottle.key.in_(keys)))
    return token


def _admit(db: Database, key: str, now: datetime, backoff: LoginBackoff) -> datetime | None:
    """Count an attempt against ``key`` as a failure (a success deletes the count) and
    set the block that follows it; or, when the key is blocked, count nothing and say
    until when.

    One conditional UPDATE: concurrent attempts on every instance serialise on the row
    (its lock on PostgreSQL, the write lock on SQLite), so once a count reaches the
    block no further attempt gets through, however many are in flight.
    """
    for _attempt in range(3):
        try:
            with db.session() as s:
                failures = s.execute(
                    update(LoginThrottle)
                    .where(
                        LoginThrottle.key == key,
                        LoginThrottle.blocked_until.is_(None)
                        | (LoginThrottle.blocked_until <= now),
                    )
                    .values(
                        failures=case(
                            (LoginThrottle.updated_at <= backoff.forget_before(now), 1),
                            else_=LoginThrottle.failures + 1,
                        ),
                        updated_at=now,
                    )
                    .returning(LoginThrottle.failures)
                    .execution_options(synchronize_session=False)
                ).scalar_one_or_none()
                if failures is None:
                    until = s.scalar(
                        select(LoginThrottle.blocked_until).where(LoginThrottle.key == key)
                    )
                    if until is not None and until > now:
                        return until
                    s.add(LoginThrottle(key=key, failures=1, blocked_until=None, updated_at=now))
                    s.flush()
                    failures = 1
                block = backoff.block_s(failures)
                if block > 0:
                    s.execute(
                        update(LoginThrottle)
                        .where(LoginThrottle.key == key)
                        .values(blocked_until=now + timedelta(seconds=block))
                        .execution_options(synchronize_session=False)
                    )
            return None
        except IntegrityError:
            continue  # another attempt inserted the key first: count on its row
    log.warning("login throttle: could not count an attempt for %s; refused", key)
    return now + timedelta(seconds=backoff.base_s)


def _forget_quiet_keys(db: Database, now: datetime, backoff: LoginBackoff) -> None:
    """Drop keys that count from zero anyway (names tried once, addresses long gone)."""
    try:
        with db.session() as s:
            s.execute(
                delete(LoginThrottle)
                .where(
                    LoginThrottle.updated_at <= backoff.forget_before(now),
                    (LoginThrottle.blocked_until.is_(None))
                    | (LoginThrottle.blocked_until <= now),
                )
                .execution_options(synchronize_session=False)
            )
    except SQLAlchemyError:  # best effort: a lost race only delays the clean-up
        log.debug("login throttle clean-up skipped", exc_info=True)
