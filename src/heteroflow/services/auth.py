"""Users, passwords, JWTs and the principal every management call acts as.

Login throttling (its rule: core/auth_policy.py), strict token checks against the
database (``authenticate``), revocation per user (``reset_password`` ->
``users.tokens_valid_after``) and for everyone (``rotate_jwt_secret``).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, Literal

import jwt
from sqlalchemy import case, delete, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from heteroflow.core.auth_policy import LoginBackoff, first_valid_iat, retry_after_s
from heteroflow.core.clock import Clock
from heteroflow.core.errors import (
    Conflict,
    NotFound,
    TooManyRequests,
    Unauthorized,
    ValidationFailed,
)
from heteroflow.core.ids import is_id, new_id
from heteroflow.db.engine import Database
from heteroflow.db.tables import LoginThrottle, Node, PlatformSetting, Tenant, User

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
    # N5: a member of a tenant with ``members_see_own`` sees only what they created
    # (services/access.py); never an operator
    own_only: bool = False

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


# ---- the node token and its rotation (docs/operations.md#node-tokens) ----

NODE_TOKEN_KEY = "node_token"  # noqa: S105 - the platform_settings row that holds it
# During a rotation: {"token": the previous token, "until": ISO time it stops working}
NODE_TOKEN_PREVIOUS_KEY = "node_token_previous"  # noqa: S105
# + a node id: when that node last authenticated with the previous token
NODE_TOKEN_SEEN_PREFIX = "node_token_seen:"  # noqa: S105
# One instance notes a node still on the previous token at most this often; a node
# counts as still on it while its newest note is younger than NODE_TOKEN_SEEN_WINDOW_S.
NODE_TOKEN_NOTE_EVERY_S = 10.0
NODE_TOKEN_SEEN_WINDOW_S = 60.0
NodeTokenMatch = Literal["current", "previous"]


@dataclass(frozen=True, slots=True)
class NodeTokenState:
    """The node tokens a server accepts: the current one and, during a rotation, the
    previous one — until ``previous_until`` (None: until it is taken away)."""

    current: str
    previous: str = ""
    previous_until: datetime | None = None

    def match(self, token: str, now: datetime) -> NodeTokenMatch | None:
        """Which token ``token`` is; both are compared (in constant time) every time."""
        given = token.encode()
        is_current = hmac.compare_digest(given, self.current.encode())
        is_previous = hmac.compare_digest(given, self.previous.encode())
        if is_current and self.current:
            return "current"
        if is_previous and self.previous and self.previous_live(now):
            return "previous"
        return None

    def previous_live(self, now: datetime) -> bool:
        return bool(self.previous) and (self.previous_until is None or now < self.previous_until)


def load_node_tokens(db: Database) -> NodeTokenState:
    """The stored node tokens (the current one is generated by the first caller)."""
    current = shared_secret(db, NODE_TOKEN_KEY)
    with db.session() as s:
        return _with_previous(current, s.get(PlatformSetting, NODE_TOKEN_PREVIOUS_KEY))


def _with_previous(current: str, row: PlatformSetting | None) -> NodeTokenState:
    if row is None:
        return NodeTokenState(current)
    try:
        data = json.loads(row.value)
        until = datetime.fromisoformat(str(data["until"]))
        until = until.replace(tzinfo=until.tzinfo or UTC)
        return NodeTokenState(current, str(data["token"]), until)
    except (ValueError, KeyError, TypeError):
        log.warning("platform_settings %s is unreadable: ignored", NODE_TOKEN_PREVIOUS_KEY)
        return NodeTokenState(current)


class NodeTokens:
    """The node token check of every agent call, on one server instance.

    A token preset from the environment (HETEROFLOW_NODE_TOKEN, with
    HETEROFLOW_NODE_TOKEN_PREVIOUS during a rotation) is fixed. Otherwise the stored ones
    (``heteroflow rotate-node-token``) are re-read every ``cache_s``, and at once (at
    most every 0.25 s) when a token matches neither: a new token works at once, the end
    of a rotation reaches every instance within ``cache_s``.
    """

    def __init__(
        self,
        db: Database,
        clock: Clock,
        *,
        preset: str = "",
        preset_previous: str = "",
        cache_s: float = 2.0,
    ) -> None:
        self._db = db
        self._clock = clock
        self._cache_s = cache_s
        self._load: Callable[[], NodeTokenState] | None = None
        if preset:
            state = NodeTokenState(preset, preset_previous)
        else:
            self._load = partial(load_node_tokens, db)
            state = self._load()
        self._cached = (state, clock.monotonic())
        self._noted: dict[str, float] = {}  # node id -> when this instance last noted it

    @property
    def current(self) -> str:
        return self._state().current

    def _state(self, *, older_than_s: float | None = None) -> NodeTokenState:
        state, loaded_at = self._cached  # one tuple: threads never see half an update
        if self._load is None:
            return state
        now = self._clock.monotonic()
        if now - loaded_at >= (self._cache_s if older_than_s is None else older_than_s):
            state = self._load()
            self._cached = (state, now)
        return state

    def check(self, token: str, node_id: str = "") -> NodeTokenMatch | None:
        """Which node token ``token`` is, or None. A node that still uses the previous
        one is noted (``node_id``: its X-Heteroflow-Node header) for
        ``heteroflow rotate-node-token --status``."""
        now = self._clock.now()
        found = self._state().match(token, now)
        if found is None and self._load is not None:
            found = self._state(older_than_s=_RECHECK_S).match(token, now)
        if found == "previous":
            self._note_previous(node_id, now)
        return found

    def _note_previous(self, node_id: str, now: datetime) -> None:
        if not is_id(node_id, "node"):
            return  # an agent's first heartbeat names no node yet
        mono = self._clock.monotonic()
        last = self._noted.get(node_id)
        if last is not None and mono - last < NODE_TOKEN_NOTE_EVERY_S:
            return
        self._noted[node_id] = mono
        key = NODE_TOKEN_SEEN_PREFIX + node_id
        try:
            with self._db.session() as s:
                row = s.get(PlatformSetting, key)
                if row is None:
                    s.add(PlatformSetting(key=key, value=now.isoformat()))
                else:
                    row.value = now.isoformat()
        except SQLAlchemyError:  # best effort (another instance wrote it first)
            log.debug("could not note node %s on the previous node token", node_id)


def rotate_node_token(db: Database, clock: Clock, previous_valid_s: float) -> NodeTokenState:
    """A new stored node token; the old one keeps working for ``previous_valid_s``.

    Refused (Conflict) while an earlier rotation's previous token still works: ending it
    would lock out the agents still on it. Returns the new state (its ``current`` is
    the new token).
    """
    if previous_valid_s < 0:
        raise ValidationFailed("must be 0 or more", field="previous_valid_s")
    now = clock.now()
    shared_secret(db, NODE_TOKEN_KEY)  # there is a current token to rotate
    new = secrets.token_urlsafe(32)
    until = now + timedelta(seconds=previous_valid_s)
    with db.session() as s:
        # locked (PostgreSQL): two rotations at once cannot both pass the check below
        row = s.get(PlatformSetting, NODE_TOKEN_KEY, with_for_update=True)
        assert row is not None
        state = _with_previous(row.value, s.get(PlatformSetting, NODE_TOKEN_PREVIOUS_KEY))
        if state.previous_live(now):
            assert state.previous_until is not None
            raise Conflict(
                "a rotation is in progress: the previous node token works until "
                f"{_utc(state.previous_until)}; end it first (rotate-node-token --finish)",
                field="node_token",
            )
        old, row.value = row.value, new
        _clear_rotation(s)
        if previous_valid_s > 0:
            value = json.dumps({"token": old, "until": until.isoformat()})
            s.add(PlatformSetting(key=NODE_TOKEN_PREVIOUS_KEY, value=value))
    log.warning("the node token was rotated; the previous one works until %s", _utc(until))
    if previous_valid_s > 0:
        return NodeTokenState(new, old, until)
    return NodeTokenState(new)


def finish_node_token_rotation(db: Database) -> bool:
    """Only the current node token works from now on (every instance within its
    ``node_token_cache_s``). False: there was no rotation to finish."""
    with db.session() as s:
        had = s.get(PlatformSetting, NODE_TOKEN_PREVIOUS_KEY) is not None
        _clear_rotation(s)
    if had:
        log.warning("node token rotation finished: the previous token no longer works")
    return had


def _clear_rotation(s: Session) -> None:
    s.execute(
        delete(PlatformSetting).where(
            (PlatformSetting.key == NODE_TOKEN_PREVIOUS_KEY)
            | PlatformSetting.key.startswith(NODE_TOKEN_SEEN_PREFIX, autoescape=True)
        )
    )


@dataclass(frozen=True, slots=True)
class NodeOnPrevious:
    node_id: str
    name: str  # "" when the node is not (or no longer) registered
    seen_at: datetime


def nodes_on_previous_token(
    db: Database, now: datetime, window_s: float = NODE_TOKEN_SEEN_WINDOW_S
) -> list[NodeOnPrevious]:
    """Nodes that authenticated with the previous node token within ``window_s``."""
    since = now - timedelta(seconds=window_s)
    found: list[NodeOnPrevious] = []
    with db.session() as s:
        rows = s.scalars(
            select(PlatformSetting).where(
                PlatformSetting.key.startswith(NODE_TOKEN_SEEN_PREFIX, autoescape=True)
            )
        ).all()
        names = {node_id: name for node_id, name in s.execute(select(Node.id, Node.name))}
        for row in rows:
            try:
                seen = datetime.fromisoformat(row.value)
            except ValueError:
                continue
            seen = seen.replace(tzinfo=seen.tzinfo or UTC)
            if seen >= since:
                node_id = row.key[len(NODE_TOKEN_SEEN_PREFIX) :]
                found.append(NodeOnPrevious(node_id, names.get(node_id, ""), seen))
    return sorted(found, key=lambda n: (n.name, n.node_id))


def _utc(t: datetime) -> str:
    return t.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


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
