"""Prefixed identifiers (tg-, task-, ep-, mr-, node-, tn-, usr-, fr-, rc-, mrq-) and API keys."""

from __future__ import annotations

import re
import secrets
import uuid

PREFIXES = ("tg", "task", "ep", "mr", "node", "tn", "usr", "ev", "fr", "sg", "rc", "mrq", "ht")
_ID_RE = re.compile(r"^(tg|task|ep|mr|node|tn|usr|ev|fr|sg|rc|mrq|ht)-[0-9a-f]{12}$")


def new_id(prefix: str) -> str:
    if prefix not in PREFIXES:
        raise ValueError(f"unknown id prefix {prefix!r}")
    return f"{prefix}-{secrets.token_hex(6)}"


def is_id(value: str, prefix: str) -> bool:
    m = _ID_RE.match(value)
    return m is not None and m.group(1) == prefix


def new_api_key() -> str:
    """``sk-{uuid}``: shown to the user once, stored only as sha256 + display prefix."""
    return f"sk-{uuid.uuid4()}"


def key_display_prefix(key: str) -> str:
    return key[:7] + "…"
