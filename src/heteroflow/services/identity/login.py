"""Login and its throttle (the rule: core/auth_policy.py), and an operator's password
reset, which revokes the user's tokens and unlocks the user name.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import case, delete, select, update
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from heteroflow.core.auth_policy import LoginBackoff, retry_after_s
from heteroflow.core.clock import Clock
from heteroflow.core.errors import NotFound, TooManyRequests, Unauthorized, ValidationFailed
from heteroflow.db.engine import Database
from heteroflow.db.tables import LoginThrottle, User
from heteroflow.services.identity.auth import Tokens
from heteroflow.services.identity.passwords import (
    MAX_PASSWORD_LENGTH,
    MIN_PASSWORD_LENGTH,
    check_password,
    hash_password,
)

log = logging.getLogger(__name__)

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
