"""Password hashes (scrypt) and the password check that costs the same for a user name
that does not exist (no user enumeration by timing).

Who uses them: ``auth.bootstrap`` (the first admin), ``tenants`` (a new user),
``login`` (the check at login, and an operator's reset).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

from heteroflow.db.tables import User

MIN_PASSWORD_LENGTH = 8  # as UserCreate
MAX_PASSWORD_LENGTH = 1024
_SCRYPT = {"n": 2**14, "r": 8, "p": 1}
# Checked when the user does not exist, so an unknown name costs the same scrypt as a
# known one (no user enumeration by timing). Random bytes: no password matches it.
_DUMMY_HASH = (
    "scrypt$NovHz12okk5GalNGE5ro3A==$+o4z8LfWua9QX82+6QqJfEAtfsrwXmotG8aPjoFG9SXKQSK3Vu6u"
    "hYtU0Heq5ikGr4SyEsMUUEMDrmyjDPRhvA=="
)



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

