"""The Responses API (``POST /v1/responses``) carried on chat completions (M14).

No engine we run speaks the Responses API, so the gateway translates: ``to_chat`` turns
a Responses request into the chat completions request that the rest of the gateway
authenticates, routes, limits, relays and accounts like any other, and ``from_chat``
turns the chat answer back into a Response object (``responses_stream`` does the same
for a stream, ``responses_adapter`` applies both at the ASGI exit). Pure functions, no I/O.
The engine's reasoning (``reasoning_content``) becomes a ``reasoning`` item.

What cannot be honoured is refused with a 400 naming the parameter, never ignored in a
way that changes the answer: ``previous_response_id``, ``conversation``, ``prompt`` and
``background`` (they need stored state; this gateway stores no responses), hosted
tools (web search, file search, computer use, ... — only ``function`` tools), item
references, file inputs, ``truncation: "auto"`` and output logprobs. ``store`` is
accepted and nothing is stored (the Response says ``"store": false``). Keys this module
does not know are passed on to the engine unchanged, as on chat completions (``top_k``,
``seed``, ...).
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from heteroflow.gateway.wire import errors

RESPONSES_PATH = "/v1/responses"
CHAT_PATH = "/v1/chat/completions"

_NO_STATE = (
    "this gateway stores no responses or conversations: send the earlier turns in `input` "
    "(the `output` items of a response may be appended to it as they are)"
)
# Set to anything but null / false / empty, these are refused: nothing can honour them.
_REFUSED = {
    "previous_response_id": f"`previous_response_id` is not supported: {_NO_STATE}.",
    "conversation": f"`conversation` is not supported: {_NO_STATE}.",
    "prompt": "`prompt` (a stored prompt template) is not supported: send the instructions "
    "and input themselves.",
    "background": "`background` responses are not supported: they need stored responses, "
    "which this gateway does not keep. Use `stream` for long answers.",
    "context_management": "`context_management` is not supported: the engine refuses an "
    "input longer than its context instead of compacting it.",
}
# Translated below, or accepted with no effect on the answer (hints and echoes).
_HANDLED = frozenset(
    {
        "model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls",
        "max_output_tokens", "temperature", "top_p", "text", "stream", "stream_options",
        "metadata", "user", "store", "reasoning", "include", "truncation", "service_tier",
        "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "max_tool_calls",
        "top_logprobs", *_REFUSED,
    }
)
_LOGPROBS_INCLUDE = "message.output_text.logprobs"
_TOOL_CHOICES = ("none", "auto", "required")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class _Refused(Exception):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def to_chat(body: dict[str, Any]) -> dict[str, Any] | errors.OpenAIError:
    """The chat completions request that answers the Responses request ``body``."""
    try:
        return _to_chat(body)
    except _Refused as exc:
        return errors.invalid_request(exc.message, exc.param)


def _to_chat(body: dict[str, Any]) -> dict[str, Any]:
    for key, why in _REFUSED.items():
        if body.get(key) not in (None, False, "", [], {}):
            raise _Refused(why, key)
    if body.get("truncation") not in (None, "disabled"):
        raise _Refused(
            "`truncation: \"auto\"` is not supported: the engine refuses an input longer "
            "than its context instead of dropping items from it.",
            "truncation",
        )
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or _LOGPROBS_INCLUDE in include):
        raise _Refused(
            f"`include: [\"{_LOGPROBS_INCLUDE}\"]` is not supported on /v1/responses here; "
            "use /v1/chat/completions with `logprobs`.",
            "include",
        )
    # Engine extras (top_k, seed, ...) go on as they are, like on chat completions.
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _HANDLED}
    chat["model"] = body["model"]
    chat["messages"] = _messages(body.get("instructions"), body.get("input"))
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _Refused("`tools` must be an array of function tools.", "tools")
        if tools:
            chat["tools"] = [_tool(i, t) for i, t in enumerate(tools)]
    choice = body.get("tool_choice")
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice, chat)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None:
        chat["parallel_tool_calls"] = _bool(parallel, "parallel_tool_calls")
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise _Refused("`max_output_tokens` must be a positive integer.", "max_output_tokens")
        chat["max_tokens"] = limit  # the spelling every engine reads
    for key in ("temperature", "top_p"):
        value = body.get(key)
        if value is not None:
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise _Refused(f"`{key}` must be a number.", key)
            chat[key] = value
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        chat["reasoning_effort"] = reasoning["effort"]
    user = body.get("user")
    if user is not None:
        if not isinstance(user, str):
            raise _Refused("`user` must be a string.", "user")
        chat["user"] = user
    if _bool(body.get("stream", False), "stream"):
        # The usage event is always asked for: response.completed carries the usage.
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _bool(value: object, param: str) -> bool:
    if not isinstance(value, bool):
        raise _Refused(f"`{param}` must be a boolean.", param)
    return value


def _messages(instructions: object, items: object) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _Refused("`instructions` must be a string.", "instructions")
        out.append({"role": "system", "content": instructions})
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
        return out
    if not isinstance(items, list) or not items:
        raise _Refused("`input` must be a string or a non-empty array of input items.", "input")
    for i, item in enumerate(items):
        _item(out, item, f"input[{i}]")
    return out


def _item(out: list[dict[str, Any]], item: object, where: str) -> None:
    if not isinstance(item, dict):
        raise _Refused(f"`{where}` must be an object.", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise _Refused(
                f"`{where}.role` must be one of user, assistant, system, developer.",
                f"{where}.role",
            )
        out.append({"role": _ROLES[role], "content": _content(item.get("content"), role, where)})
    elif kind == "function_call":
        call = {
            "id": _str(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _str(item, "name", where),
                "arguments": _str(item, "arguments", where),
            },
        }
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # parallel calls: one message
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        content = output if isinstance(output, str) else _text_parts(output, f"{where}.output")
        out.append(
            {"role": "tool", "tool_call_id": _str(item, "call_id", where), "content": content}
        )
    elif kind == "reasoning":
        pass  # this gateway never produces one; another model's is not for this engine
    elif kind == "item_reference":
        raise _Refused(f"Item references are not supported: {_NO_STATE}.", f"{where}.type")
    else:
        raise _Refused(
            f"Input items of type '{kind}' are not supported: only messages, function_call "
            "and function_call_output items (hosted tools are not available).",
            f"{where}.type",
        )


def _str(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _Refused(f"`{where}.{key}` must be a string.", f"{where}.{key}")
    return value


def _content(content: object, role: str, where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _Refused(
            f"`{where}.content` must be a string or an array of content parts.",
            f"{where}.content",
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise _Refused(f"`{at}` must be an object.", at)
        kind, text = part.get("type"), part.get("text", part.get("refusal"))
        if kind in ("input_text", "output_text", "refusal") and isinstance(text, str):
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and role == "user":
            parts.append(_image(part, at))
        elif kind == "input_file":
            raise _Refused("File inputs are not supported: send the file's text.", at)
        else:
            raise _Refused(f"`{at}` is not a content part this message can carry.", at)
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _image(part: dict[str, Any], at: str) -> dict[str, Any]:
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise _Refused(
            "Images must be sent as `image_url` (a URL or a data: URL); file ids need the "
            "files API, which this gateway does not have.",
            f"{at}.image_url",
        )
    image: dict[str, Any] = {"url": url}
    if isinstance(part.get("detail"), str):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _text_parts(output: object, where: str) -> str:
    texts: list[str] = []
    for part in output if isinstance(output, list) else [None]:
        text = None
        if isinstance(part, dict) and part.get("type") == "input_text":
            text = part.get("text")
        if not isinstance(text, str):
            raise _Refused(f"`{where}` must be a string or an array of input_text parts.", where)
        texts.append(text)
    return "\n".join(texts)


def _tool(i: int, tool: object) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise _Refused(f"`{where}` must be an object.", where)
    kind = tool.get("type")
    if kind != "function":
        raise _Refused(
            f"Tools of type '{kind}' are not available: the engine runs no hosted tools "
            "(web search, file search, computer use, ...); only `function` tools are supported.",
            f"{where}.type",
        )
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _Refused(f"`{where}.name` must be a non-empty string.", f"{where}.name")
    fn: dict[str, Any] = {"name": name}
    for key, kinds in (("description", str), ("parameters", dict), ("strict", bool)):
        value = tool.get(key)
        if value is not None:
            if not isinstance(value, kinds):
                raise _Refused(f"`{where}.{key}` has the wrong type.", f"{where}.{key}")
            fn[key] = value
    return {"type": "function", "function": fn}


def _tool_choice(choice: object, chat: dict[str, Any]) -> object:
    if choice in _TOOL_CHOICES:
        return choice
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        mode, allowed = choice.get("mode"), choice.get("tools")
        if kind == "allowed_tools" and mode in ("auto", "required") and isinstance(allowed, list):
            names = {
                t.get("name")
                for t in allowed
                if isinstance(t, dict) and t.get("type") == "function"
            }
            if len(names) == len(allowed):
                tools = chat.get("tools", ())
                chat["tools"] = [t for t in tools if t["function"]["name"] in names]
                return mode
    raise _Refused(
        "`tool_choice` must be none, auto, required, a function "
        '({"type": "function", "name": ...}) or allowed function tools; hosted tools are '
        "not available.",
        "tool_choice",
    )


def _response_format(text: object) -> dict[str, Any] | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema" and isinstance(fmt, dict):
        name, schema = fmt.get("name"), fmt.get("schema")
        if not isinstance(name, str) or not isinstance(schema, dict):
            raise _Refused(
                "`text.format` of type json_schema needs a `name` and a `schema` object.",
                "text.format",
            )
        spec: dict[str, Any] = {"name": name, "schema": schema}
        for key in ("description", "strict"):
            if fmt.get(key) is not None:
                spec[key] = fmt[key]
        return {"type": "json_schema", "json_schema": spec}
    raise _Refused(
        "`text.format.type` must be text, json_object or json_schema.", "text.format.type"
    )


# -- the answer ------------------------------------------------------------------------


def response_object(
    request: dict[str, Any], *, rid: str, created_at: float, model: str
) -> dict[str, Any]:
    """A Response in progress with nothing generated yet: what OpenAI echoes of the
    request, the rest at its defaults."""
    tools = request.get("tools") or []
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "max_tool_calls": request.get("max_tool_calls"),
        "metadata": request.get("metadata") or {},
        "model": model,
        "output": [],
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": request.get("reasoning"),
        "store": False,  # nothing is stored: a GET of this id finds nothing
        "temperature": request.get("temperature"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": [
            {
                "type": "function",
                "name": t["name"],
                "description": t.get("description"),
                "parameters": t.get("parameters"),
                "strict": t.get("strict"),
            }
            for t in tools
        ],
        "top_p": request.get("top_p"),
        "truncation": "disabled",
        "usage": None,
        "user": request.get("user"),
    }


def finished(
    response: dict[str, Any],
    output: list[dict[str, Any]],
    finish_reason: object,
    usage: object,
) -> dict[str, Any]:
    """``response`` once generated: its output, status and usage."""
    reason = _INCOMPLETE.get(finish_reason) if isinstance(finish_reason, str) else None
    return {
        **response,
        "status": "completed" if reason is None else "incomplete",
        "completed_at": None if reason is not None else time.time(),
        "incomplete_details": None if reason is None else {"reason": reason},
        "output": output,
        "usage": response_usage(usage),
    }


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def item_status(finish_reason: object) -> str:
    return "incomplete" if finish_reason in _INCOMPLETE else "completed"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text)] if status != "in_progress" else [],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The engine's reasoning (``reasoning_content``: llama.cpp, vLLM, SGLang), as the
    Responses API shows an open-weight model's: ``reasoning_text`` content."""
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": [reasoning_part(text)] if status != "in_progress" else [],
    }


def reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def response_usage(usage: object) -> dict[str, Any] | None:
    """Chat usage in the Responses spelling; None when the engine reported none."""
    if not isinstance(usage, dict):
        return None
    inp = _int(usage.get("prompt_tokens"))
    out = _int(usage.get("completion_tokens"))
    prompt_details = usage.get("prompt_tokens_details")
    output_details = usage.get("completion_tokens_details")
    cached = _int(prompt_details.get("cached_tokens")) if isinstance(prompt_details, dict) else 0
    reasoning = (
        _int(output_details.get("reasoning_tokens")) if isinstance(output_details, dict) else 0
    )
    return {
        "input_tokens": inp,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": reasoning},
        "total_tokens": _int(usage.get("total_tokens")) or inp + out,
    }


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def from_chat(
    chat: dict[str, Any],
    request: dict[str, Any],
    *,
    model: str | None = None,
    rid: str | None = None,
) -> dict[str, Any]:
    """The Response for the Responses request ``request`` whose chat answer is ``chat``.

    ``model`` is the name the client used (default: the request's); the engine's own
    model id in ``chat`` is not shown."""
    choices = chat.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else {}
    message = choice.get("message") or {}
    reason = choice.get("finish_reason")
    status = item_status(reason)
    output: list[dict[str, Any]] = []
    thought = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(thought, str) and thought:
        output.append(reasoning_item(new_id("rs"), thought, status))
    content, refusal = message.get("content"), message.get("refusal")
    calls = message.get("tool_calls") or []
    if isinstance(refusal, str) and refusal:
        output.append(
            {
                **message_item(new_id("msg"), "", status),
                "content": [{"type": "refusal", "refusal": refusal}],
            }
        )
    elif (isinstance(content, str) and content) or not calls:
        text = content if isinstance(content, str) else ""
        output.append(message_item(new_id("msg"), text, status))
    for call in calls:
        fn = call.get("function") or {}
        output.append(
            call_item(
                new_id("fc"),
                call.get("id") or new_id("call"),
                fn.get("name") or "",
                fn.get("arguments") or "",
                status,
            )
        )
    created = chat.get("created")
    response = response_object(
        request,
        rid=rid or new_id("resp"),
        created_at=created if isinstance(created, int | float) else time.time(),
        model=model or request["model"],
    )
    return finished(response, output, reason, chat.get("usage"))
