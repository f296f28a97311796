"""The pieces the gateway's request checks (``requests``) are built from.

A check is a function of one JSON value that returns nothing or raises ``Bad``: where the
value broke the shape (a param path, relative while the error unwinds through the nested
checks, each adding its part: ``within``) and how (OpenAI's wording and ``code``, rendered
once the full path is known). Raising keeps the passing path free of result plumbing, and
an error object is only built for a body that fails. Type tests use ``type(v) is ...``:
exact (a JSON ``true`` is no number) and the cheapest test there is.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from heteroflow.gateway.wire.errors import OpenAIError

Check = Callable[[Any], None]
_GOT = {
    str: "a string",
    int: "an integer",
    float: "a decimal number",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


class Bad(Exception):
    """A broken shape: where (a param path, relative while it unwinds) and what."""

    __slots__ = ("code", "path", "render")

    def __init__(self, path: str, render: Callable[[str], str], code: str | None) -> None:
        self.path = path
        self.render = render
        self.code = code

    def within(self, prefix: str) -> Bad:
        p = self.path
        self.path = prefix if not p else (prefix + p if p[0] == "[" else f"{prefix}.{p}")
        return self

    def error(self) -> OpenAIError:
        path = self.path
        return OpenAIError(400, self.render(path), "invalid_request_error", path, self.code)


def show(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 64 else s[:61] + "..."


def type_error(path: str, expected: str, v: Any) -> Bad:
    got = _GOT.get(type(v), "a value")
    return Bad(
        path,
        lambda p: f"Invalid type for '{p}': expected {expected}, but got {got} instead.",
        "invalid_type",
    )


def missing(path: str) -> Bad:
    return Bad(path, lambda p: f"Missing required parameter: '{p}'.", "missing_required_parameter")


def invalid_value(path: str, v: Any, allowed: tuple[str, ...]) -> Bad:
    if type(v) is not str:
        return type_error(path, "a string", v)
    names = [f"'{a}'" for a in allowed]
    if len(names) <= 2:
        supported = " and ".join(names)
    else:
        supported = ", ".join(names[:-1]) + ", and " + names[-1]
    return Bad(
        path,
        lambda _: f"Invalid value: '{show(v)}'. Supported values are: {supported}.",
        "invalid_value",
    )


def out_of_range(path: str, kind: str, v: Any, limit: float, *, above: bool) -> Bad:
    side, op = ("above maximum", "<=") if above else ("below minimum", ">=")
    return Bad(
        path,
        lambda p: f"Invalid '{p}': {kind} {side} value. "
        f"Expected a value {op} {limit}, but got {show(v)} instead.",
        f"{kind}_{'above_max' if above else 'below_min'}_value",
    )


def empty_array(path: str) -> Bad:
    return Bad(
        path,
        lambda p: f"Invalid '{p}': empty array. Expected an array with minimum length 1, "
        "but got an empty array instead.",
        "empty_array",
    )


def too_long(path: str, limit: int, n: int) -> Bad:
    return Bad(
        path,
        lambda p: f"Invalid '{p}': array too long. Expected an array with maximum length "
        f"{limit}, but got an array with length {n} instead.",
        "array_above_max_length",
    )


def conflict(path: str, why: str) -> Bad:
    return Bad(path, lambda p: f"Invalid value for '{p}': {why}", None)


# -- scalar checks (a relative path of "" means: the field itself) --


def string(v: Any) -> None:
    if type(v) is not str:
        raise type_error("", "a string", v)


def boolean(v: Any) -> None:
    if type(v) is not bool:
        raise type_error("", "a boolean", v)


def json_object(v: Any) -> None:
    if type(v) is not dict:
        raise type_error("", "an object", v)


def integer(v: Any) -> None:
    if type(v) is not int:
        raise type_error("", "an integer", v)


def decimal(lo: float, hi: float) -> Check:
    def check(v: Any) -> None:
        t = type(v)
        if t is not float and t is not int:
            raise type_error("", "a decimal", v)
        if v < lo:
            raise out_of_range("", "decimal", v, lo, above=False)
        if v > hi:
            raise out_of_range("", "decimal", v, hi, above=True)

    return check


def int_range(lo: int, hi: int | None = None) -> Check:
    def check(v: Any) -> None:
        if type(v) is not int:
            raise type_error("", "an integer", v)
        if v < lo:
            raise out_of_range("", "integer", v, lo, above=False)
        if hi is not None and v > hi:
            raise out_of_range("", "integer", v, hi, above=True)

    return check


def enum(*allowed: str) -> Check:
    members = frozenset(allowed)

    def check(v: Any) -> None:
        if type(v) is not str or v not in members:
            raise invalid_value("", v, allowed)

    return check


def field(obj: dict[str, Any], key: str, check: Check, *, required: bool = False) -> None:
    """``obj[key]`` through ``check``; absent or null passes unless ``required`` (a
    required null fails ``check``'s own type test)."""
    v = obj.get(key)
    if v is None:
        if not required:
            return
        if key not in obj:
            raise missing(key)
    try:
        check(v)
    except Bad as e:
        raise e.within(key) from None


def each(items: list[Any], check: Check) -> None:
    for i, item in enumerate(items):
        try:
            check(item)
        except Bad as e:
            raise e.within(f"[{i}]") from None


def typed(obj: Any, kinds: Mapping[str, Check]) -> None:
    """An object whose ``type`` picks its shape among ``kinds``."""
    if type(obj) is not dict:
        raise type_error("", "an object", obj)
    kind = obj.get("type")
    check = kinds.get(kind) if type(kind) is str else None
    if check is None:
        raise missing("type") if kind is None else invalid_value("type", kind, tuple(kinds))
    check(obj)


def non_empty_array(v: Any) -> None:
    if type(v) is not list:
        raise type_error("", "an array", v)
    if not v:
        raise empty_array("")
