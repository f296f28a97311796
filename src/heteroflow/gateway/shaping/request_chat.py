"""OpenAI's shapes for the parts of a chat completions request: ``messages`` (per role,
with their content parts and tool calls), ``tools``, ``tool_choice``, ``response_format``
and the deprecated ``functions`` / ``function_call``. Checks built from
``request_rules``; ``requests`` puts them in the body's table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from heteroflow.gateway.policy.request_rules import (
    Bad,
    Check,
    boolean,
    conflict,
    each,
    empty_array,
    enum,
    field,
    invalid_value,
    json_object,
    missing,
    non_empty_array,
    string,
    too_long,
    type_error,
    typed,
)

_TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128


# -- messages and their content parts --


def _text_part(part: dict[str, Any]) -> None:
    field(part, "text", string, required=True)


def _image_part(part: dict[str, Any]) -> None:
    field(part, "image_url", _image_url, required=True)


def _image_url(v: Any) -> None:
    json_object(v)
    field(v, "url", string, required=True)
    field(v, "detail", enum("auto", "low", "high", "original"))


def _audio_part(part: dict[str, Any]) -> None:
    field(part, "input_audio", _input_audio, required=True)


def _input_audio(v: Any) -> None:
    json_object(v)
    field(v, "data", string, required=True)
    field(v, "format", enum("wav", "mp3"), required=True)


def _file_part(part: dict[str, Any]) -> None:
    field(part, "file", _file, required=True)


def _file(v: Any) -> None:
    json_object(v)
    for key in ("file_data", "file_id", "filename"):
        field(v, key, string)


def _refusal_part(part: dict[str, Any]) -> None:
    field(part, "refusal", string, required=True)


def _engine_part(part: dict[str, Any]) -> None:
    """Part types engines add (vLLM, SGLang: video and audio by URL): theirs to check."""


_TEXT_PARTS: Mapping[str, Check] = {"text": _text_part}
_ASSISTANT_PARTS: Mapping[str, Check] = {"text": _text_part, "refusal": _refusal_part}
_USER_PARTS: Mapping[str, Check] = {
    "text": _text_part,
    "image_url": _image_part,
    "input_audio": _audio_part,
    "file": _file_part,
    "video_url": _engine_part,
    "audio_url": _engine_part,
}


def _content(m: dict[str, Any], parts: Mapping[str, Check], *, required: bool = True) -> None:
    c = m.get("content")
    if type(c) is str:
        return
    if type(c) is list:
        if not c:
            raise empty_array("content")
        for j, part in enumerate(c):
            try:
                typed(part, parts)
            except Bad as e:
                raise e.within(f"content[{j}]") from None
        return
    if c is None and not required:
        return
    if c is None and "content" not in m:
        raise missing("content")
    raise type_error("content", "one of a string or array of objects", c)


def _system(m: dict[str, Any]) -> None:
    _content(m, _TEXT_PARTS)


def _user(m: dict[str, Any]) -> None:
    _content(m, _USER_PARTS)


def _tool_message(m: dict[str, Any]) -> None:
    _content(m, _TEXT_PARTS)
    field(m, "tool_call_id", string, required=True)


def _function_message(m: dict[str, Any]) -> None:
    field(m, "content", string)
    field(m, "name", string, required=True)


def _assistant(m: dict[str, Any]) -> None:
    _content(m, _ASSISTANT_PARTS, required=False)
    field(m, "refusal", string)
    calls = m.get("tool_calls")
    if calls is not None:
        try:
            non_empty_array(calls)
            each(calls, _tool_call)
        except Bad as e:
            raise e.within("tool_calls") from None
    elif m.get("content") is None and m.get("function_call") is None and m.get("audio") is None:
        raise conflict("content", "expected a string, got null.")


def _tool_call(v: Any) -> None:
    typed(v, _FUNCTION_KIND_CALL)


def _function_call_shape(v: dict[str, Any]) -> None:
    field(v, "id", string, required=True)
    field(v, "function", _call_function, required=True)


def _call_function(v: Any) -> None:
    json_object(v)
    field(v, "name", string, required=True)
    field(v, "arguments", string, required=True)


_FUNCTION_KIND_CALL: Mapping[str, Check] = {"function": _function_call_shape}
_ROLES: Mapping[str, Check] = {
    "system": _system,
    "user": _user,
    "assistant": _assistant,
    "tool": _tool_message,
    "function": _function_message,
    "developer": _system,
}


def _message(m: Any) -> None:
    if type(m) is not dict:
        raise type_error("", "an object", m)
    role = m.get("role")
    check = _ROLES.get(role) if type(role) is str else None
    if check is None:
        raise missing("role") if role is None else invalid_value("role", role, tuple(_ROLES))
    check(m)
    name = m.get("name")  # where it is required (role "function"), the role's check saw it
    if name is not None and type(name) is not str:
        raise type_error("name", "a string", name)


def messages(v: Any) -> None:
    non_empty_array(v)
    each(v, _message)


# -- tools, tool choice, response format --


def tools(v: Any) -> None:
    non_empty_array(v)
    if len(v) > MAX_TOOLS:
        raise too_long("", MAX_TOOLS, len(v))
    each(v, _tool)


def _tool(v: Any) -> None:
    typed(v, _FUNCTION_KIND_TOOL)


def _function_tool(v: dict[str, Any]) -> None:
    field(v, "function", _function_definition, required=True)


def _function_definition(v: Any) -> None:
    json_object(v)
    field(v, "name", _tool_name, required=True)
    field(v, "description", string)
    field(v, "parameters", json_object)
    field(v, "strict", boolean)


def _tool_name(v: Any) -> None:
    string(v)
    if _TOOL_NAME.fullmatch(v) is None:
        raise Bad(
            "",
            lambda p: f"Invalid '{p}': string does not match pattern. Expected a string that "
            "matches the pattern '^[a-zA-Z0-9_-]{1,64}$'.",
            "invalid_value",
        )


_FUNCTION_KIND_TOOL: Mapping[str, Check] = {"function": _function_tool}


_CHOICE_MODE = enum("none", "auto", "required")
_CALL_MODE = enum("none", "auto")


def tool_choice(v: Any) -> None:
    if type(v) is str:
        _CHOICE_MODE(v)
        return
    if type(v) is not dict:
        raise type_error("", "one of a string or an object", v)
    typed(v, _FUNCTION_KIND_CHOICE)


def _named_choice(v: dict[str, Any]) -> None:
    field(v, "function", _named_function, required=True)


def _named_function(v: Any) -> None:
    json_object(v)
    field(v, "name", string, required=True)


_FUNCTION_KIND_CHOICE: Mapping[str, Check] = {"function": _named_choice}


def _json_schema_format(v: dict[str, Any]) -> None:
    field(v, "json_schema", _json_schema, required=True)


def _json_schema(v: Any) -> None:
    json_object(v)
    field(v, "name", string, required=True)
    field(v, "schema", json_object)
    field(v, "strict", boolean)


def _plain_format(v: dict[str, Any]) -> None:
    """``text`` and ``json_object`` carry nothing else OpenAI defines."""


_FORMATS: Mapping[str, Check] = {
    "text": _plain_format,
    "json_object": _plain_format,
    "json_schema": _json_schema_format,
}


def response_format(v: Any) -> None:
    typed(v, _FORMATS)


def functions(v: Any) -> None:
    non_empty_array(v)
    each(v, _function_definition)


def function_call(v: Any) -> None:
    if type(v) is str:
        _CALL_MODE(v)
    else:
        _named_function(v)
