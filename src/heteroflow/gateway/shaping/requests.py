"""OpenAI's request shapes, checked at the gateway before any engine sees a request.

``check(path, body)`` takes the dict orjson parsed from a ``POST /v1/chat/completions``,
``/v1/completions`` or ``/v1/embeddings`` body and answers ``None`` (pass it on) or the
400 OpenAI would give: ``invalid_request_error`` with ``param`` naming the field as
OpenAI does (``messages[0].role``, ``tools[1].function.name``, ``temperature``) and
OpenAI's wording and ``code`` (``invalid_type``, ``decimal_above_max_value``,
``empty_array``, ``missing_required_parameter``, ``invalid_value``, ...). Engines answer
such mistakes in their own shape or with a 5xx (which the SDKs retry and which ejects a
healthy replica from routing); here they never reach one.

Only keys OpenAI defines are checked; every other key passes through untouched, because
engines take their own parameters (``top_k``, ``min_p``, ``chat_template_kwargs``, ...).
``null`` is accepted wherever a key is optional. Where OpenAI offers something no engine
can do (``custom`` tools, ``allowed_tools``), the check refuses it with the same 400.

Hand-written checks over the parsed dict, dispatched by key (a table per path here; the
chat parts in ``request_chat``; the pieces in ``request_rules``): the check runs on every
inference request, within the gateway's CPU budget (bench/request_check.py measures it
against orjson.loads of the same body).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from heteroflow.gateway.policy.request_rules import (
    Bad,
    Check,
    boolean,
    conflict,
    decimal,
    each,
    empty_array,
    enum,
    field,
    int_range,
    integer,
    json_object,
    missing,
    non_empty_array,
    show,
    string,
    too_long,
    type_error,
)
from heteroflow.gateway.shaping import request_chat as chat
from heteroflow.gateway.wire.errors import OpenAIError

MAX_STOP = 4
MAX_EMBEDDING_INPUTS = 2048


def _stop(v: Any) -> None:
    if type(v) is str:
        return
    if type(v) is not list:
        raise type_error("", "one of a string or array of strings", v)
    if len(v) > MAX_STOP:
        raise too_long("", MAX_STOP, len(v))
    each(v, string)


def _logit_bias(v: Any) -> None:
    if type(v) is not dict:
        raise type_error("", "an object", v)
    for token, bias in v.items():
        t = type(bias)
        if (
            not (token.isascii() and token.isdigit())
            or (t is not int and t is not float)
            or not -100 <= bias <= 100
        ):
            raise _bad_bias(token, bias)


def _bad_bias(token: str, bias: Any) -> Bad:
    if not (token.isascii() and token.isdigit()):
        return Bad(
            "",
            lambda p: f"Invalid key in '{p}': '{show(token)}' is not a token id.",
            "invalid_value",
        )
    if type(bias) is not int and type(bias) is not float:
        return type_error("", "a decimal", bias)
    return Bad(
        "",
        lambda p: f"Invalid value for '{p}': the bias of token {token} must be between "
        f"-100 and 100, but got {show(bias)} instead.",
        "invalid_value",
    )


def _stream_options(v: Any) -> None:
    json_object(v)
    field(v, "include_usage", boolean)
    field(v, "include_obfuscation", boolean)


# -- prompts and embedding inputs --


def _tokens(v: Any) -> None:
    non_empty_array(v)
    each(v, integer)


def _text_or_tokens(*, max_items: int | None, non_empty: bool) -> Check:
    """A string, or an array of strings, of token ids, or of token-id arrays."""

    def text(v: Any) -> None:
        string(v)
        if non_empty and not v:
            raise Bad(
                "",
                lambda p: f"Invalid '{p}': empty string. Expected a string with minimum "
                "length 1, but got an empty string instead.",
                "empty_string",
            )

    def check(v: Any) -> None:
        if type(v) is str:
            text(v)
            return
        if type(v) is not list:
            raise type_error("", "one of a string or array of strings or tokens", v)
        if not v:
            raise empty_array("")
        if max_items is not None and len(v) > max_items:
            raise too_long("", max_items, len(v))
        first = type(v[0])
        if first is str:
            # A batch of texts is the common large body: one tight pass, and the
            # per-item check only to say which item broke it.
            for x in v:
                if type(x) is not str or (non_empty and not x):
                    each(v, text)  # raises, naming the first bad item
            return
        each(v, _tokens if first is list else integer)

    return check


# -- the three bodies --

_SAMPLING: dict[str, Check] = {
    "temperature": decimal(0, 2),
    "top_p": decimal(0, 1),
    "presence_penalty": decimal(-2, 2),
    "frequency_penalty": decimal(-2, 2),
    "n": int_range(1, 128),
    "stop": _stop,
    "seed": integer,
    "logit_bias": _logit_bias,
    "stream": boolean,
    "stream_options": _stream_options,
    "user": string,
}
_CHAT: dict[str, Check] = {
    **_SAMPLING,
    "messages": chat.messages,
    "max_tokens": int_range(1),
    "max_completion_tokens": int_range(1),
    "logprobs": boolean,
    "top_logprobs": int_range(0, 20),
    "tools": chat.tools,
    "tool_choice": chat.tool_choice,
    "parallel_tool_calls": boolean,
    "functions": chat.functions,
    "function_call": chat.function_call,
    "response_format": chat.response_format,
    "reasoning_effort": enum("none", "minimal", "low", "medium", "high", "xhigh", "max"),
    "verbosity": enum("low", "medium", "high"),
    "metadata": json_object,
    "store": boolean,
}
_COMPLETIONS: dict[str, Check] = {
    **_SAMPLING,
    "prompt": _text_or_tokens(max_items=None, non_empty=False),
    "max_tokens": int_range(0),  # 0 with echo scores a prompt (lm-eval's loglikelihood)
    "logprobs": int_range(0, 5),
    "best_of": int_range(0, 20),
    "echo": boolean,
    "suffix": string,
}
_EMBEDDINGS: dict[str, Check] = {
    "input": _text_or_tokens(max_items=MAX_EMBEDDING_INPUTS, non_empty=True),
    "encoding_format": enum("float", "base64"),
    "dimensions": int_range(1),
    "user": string,
}


def _fields(body: dict[str, Any], table: Mapping[str, Check], required: str) -> None:
    if required not in body:
        raise missing(required)
    for key, value in body.items():
        check = table.get(key)
        if check is None:
            continue  # not OpenAI's: the engine's business
        if value is None and key != required:
            continue  # null: OpenAI's default
        try:
            check(value)
        except Bad as e:
            raise e.within(key) from None


def _stream_rules(body: dict[str, Any]) -> None:
    if body.get("stream_options") is not None and body.get("stream") is not True:
        raise Bad(
            "stream_options",
            lambda _: "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            None,
        )


def _chat(body: dict[str, Any]) -> None:
    _fields(body, _CHAT, "messages")
    _stream_rules(body)
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise conflict("top_logprobs", "'logprobs' must be true when 'top_logprobs' is set.")
    choice = body.get("tool_choice")
    if choice is None or choice == "none" or choice == "auto":
        return
    declared = body.get("tools")  # checked above, like tool_choice: only the names to see
    if declared is None:
        raise conflict("tool_choice", "'tool_choice' is only allowed when 'tools' are specified.")
    if type(choice) is dict:
        name = choice["function"]["name"]
        if all(t["function"]["name"] != name for t in declared):
            raise conflict("tool_choice", f"no function named '{show(name)}' among the 'tools'.")


def _completions(body: dict[str, Any]) -> None:
    _fields(body, _COMPLETIONS, "prompt")
    _stream_rules(body)


def _embeddings(body: dict[str, Any]) -> None:
    _fields(body, _EMBEDDINGS, "input")


_BODIES: Mapping[str, Callable[[dict[str, Any]], None]] = {
    "/v1/chat/completions": _chat,
    "/v1/completions": _completions,
    "/v1/embeddings": _embeddings,
}


def check(path: str, body: dict[str, Any]) -> OpenAIError | None:
    """``None`` when ``body`` fits OpenAI's request shape for ``path`` (or ``path`` has
    none here), else the 400 that names the first field that does not."""
    rules = _BODIES.get(path)
    if rules is None:
        return None
    try:
        rules(body)
    except Bad as e:
        return e.error()
    return None
