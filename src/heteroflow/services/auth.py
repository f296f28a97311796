"""Users, passwords, JWTs and the principal every management call acts as."""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta

import jwt
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from heteroflow.core.clock import Clock
from heteroflow.core.errors import Unauthorized
from heteroflow.core.ids import new_id
from heteroflow.db.engine import Database
from heteroflow.db.tables import PlatformSetting, Tenant, User

log = logging.getLogger(__name__)

OPERATOR = "operator"
MEMBER = "member"
DEFAULT_TENANT = "default"
_SCRYPT = {"n": 2**14, "r": 8, "p": 1}


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


class Tokens:
    """Issues and verifies the management API's JWTs."""

    def __init__(self, secret: str, ttl_s: float, clock: Clock) -> None:
        self._secret = secret
        self._ttl = ttl_s
        self._clock = clock

    def issue(self, user: User) -> str:
        now: datetime = self._clock.now()
        claims = {
            "sub": user.id,
            "name": user.username,
            "tenant": user.tenant_id,
            "role": user.role,
            "iat": int(now.timestamp()),
            "exp": int((now + timedelta(seconds=self._ttl)).timestamp()),
        }
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def verify(self, token: str) -> Principal:
        try:
            claims = jwt.decode(
                token,
                self._secret,
                algorithms=["HS256"],
                options={"require": ["exp", "sub"], "verify_exp": False},
            )
        except jwt.PyJWTError as exc:
            raise Unauthorized("invalid token") from exc
        if int(claims["exp"]) < int(self._clock.now().timestamp()):
            raise Unauthorized("token expired")
        return Principal(
            user_id=str(claims["sub"]),
            username=str(claims.get("name", "")),
            tenant_id=str(claims["tenant"]),
            role=str(claims["role"]),
        )


def login(s: Session, tokens: Tokens, username: str, password: str) -> str:
    user = s.scalar(select(User).where(User.username == username))
    if user is None or not verify_password(password, user.password_hash):
        raise Unauthorized("wrong username or password")
    return tokens.issue(user)
