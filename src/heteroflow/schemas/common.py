"""Shared wire pieces, and the limits every request field is held to (issue 10, item 6).

Requests are strict: a JSON ``true`` is not the integer 1, ``1.0`` is not an integer and
``"1"`` is neither (a JSON integer is still a fine float). Every string has a maximum
length and refuses NUL characters and lone surrogates (``SafeStr``: neither PostgreSQL
nor a path on the node can hold them); every number has a range that fits the column it
lands in (``MAX_INT32``: PostgreSQL ``integer``), so a 64-bit value is a 400 here, never
a driver error.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, SecretStr, StringConstraints

MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MAX_ID_LENGTH = 64  # ids are "tg-" + 12 hex digits; this bounds what a caller may send
MAX_TEXT_ITEM = 4096  # one env item, command / engine_args item, argv item


def no_nul(value: str) -> str:
    """Refuse NUL characters and lone surrogates (not text PostgreSQL or a path can hold)."""
    if "\x00" in value:
        raise ValueError("a NUL character is not allowed")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("not valid Unicode text (a lone surrogate)") from None
    return value


def no_nul_secret(value: SecretStr) -> SecretStr:
    """``no_nul`` for a secret (a password kept out of reprs and logs)."""
    no_nul(value.get_secret_value())
    return value


def scrub(value: str) -> str:
    """Free text an agent relays (engine output, error messages): NUL and lone
    surrogates become U+FFFD instead of refusing the whole report."""
    if "\x00" in value:
        value = value.replace("\x00", "\ufffd")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in value)
    return value


# Every request string is one of these, with a ``max_length`` (``Field(max_length=...)``
# on the field; a test walks the request schemas to hold that line).
SafeStr = Annotated[str, AfterValidator(no_nul)]
ScrubbedStr = Annotated[str, AfterValidator(scrub)]
# What a path or query parameter naming an object may be (ids are "tg-" + 12 hex digits).
ID_PATTERN = r"^[A-Za-z0-9._-]+$"
IdStr = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_ID_LENGTH, pattern=ID_PATTERN),
    AfterValidator(no_nul),
]

# Names of task groups, endpoints, tenants, sharing groups (also a DNS-label-like bound).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
NameStr = Annotated[
    str, StringConstraints(max_length=63, pattern=NAME_PATTERN), AfterValidator(no_nul)
]

# Labels (task groups, nodes): at most 64, keys like Kubernetes label keys.
LABEL_KEY_PATTERN = r"^[A-Za-z0-9]([A-Za-z0-9._/-]{0,61}[A-Za-z0-9])?$"
MAX_LABELS = 64
MAX_LABEL_VALUE = 256
LabelKey = Annotated[
    str, StringConstraints(max_length=63, pattern=LABEL_KEY_PATTERN), AfterValidator(no_nul)
]
LabelValue = Annotated[
    str, StringConstraints(max_length=MAX_LABEL_VALUE), AfterValidator(no_nul)
]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_LABELS)]
TextItem = Annotated[str, StringConstraints(max_length=MAX_TEXT_ITEM), AfterValidator(no_nul)]


EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9000, 1, 1, tzinfo=UTC)


def to_utc(value: datetime) -> datetime:
    """A time as UTC (no zone: UTC), between 1970 and 9000: far-off years with an offset
    would overflow the conversion (a 500), and no usage or event lies outside."""
    try:
        t = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise ValueError("the time is out of range") from None
    if not EARLIEST <= t < LATEST:
        raise ValueError("the time must lie between 1970 and 9000")
    return t


UtcTime = Annotated[datetime, AfterValidator(to_utc)]


class Strict(BaseModel):
    """Requests reject unknown fields (a typo must fail loudly, not be ignored) and take
    no coercion: no bool for int, no float for int, no number for a string, no NaN."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class ErrorBody(BaseModel):
    code: str
    message: str
    field: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
