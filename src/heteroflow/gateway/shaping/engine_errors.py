"""Engine errors in OpenAI's shape (issue 15, item 4; M13, M5).

Pure functions, no I/O; the relay (``app._relay``) calls them on every answer with a
status >= 400. Whatever the engine answered — llama.cpp's ``{"error": {"code": 400,
"type": "exceed_context_size_error", ...}}``, vLLM's ``{"error": {..., "code": 400}}``
or the older ``{"object": "error", ...}`` (SGLang too), FastAPI's ``{"detail": [...]}``
(422), plain text, an HTML page — becomes OpenAI's ``{"error": {"message", "type",
"param", "code"}}`` with a string (or null) ``code`` and ``param`` (``engine_error``).

Client mistakes are 4xx whatever status the engine used (a 500 for an image sent to a
text model or tools it cannot parse, a 501 for embeddings on a chat model, a 422 from
validation); the prompt that does not fit is ``context_length_exceeded``. Only what is
left at >= 500 is a backend fault (``is_backend_fault``): the only kind of answer that
ejects a backend from routing (M5).
"""

from __future__ import annotations

import re
from typing import Literal

import orjson

from heteroflow.gateway.wire.errors import OpenAIError, context_length_exceeded

Kind = Literal["chat", "completions", "embeddings"]
KINDS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": "embeddings",
}

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_MAX_MESSAGE = 2000  # characters of an engine's message kept (a plain-text body can be long)
# The message says the prompt does not fit the context (llama.cpp, vLLM, SGLang, OpenAI).
_CONTEXT_PHRASES = (
    "exceeds the available context size",  # llama.cpp
    "maximum context length",  # vLLM, OpenAI
    "longer than the model's context length",  # SGLang
    "context length exceeded",
    "context_length_exceeded",
    "exceed_context_size",
)
# llama.cpp: "request (1629 tokens) exceeds the available context size (256 tokens), ...";
# vLLM: "This model's maximum context length is 4096 tokens. However, you requested 5000
# tokens (...)" (the same sentence in OpenAI's older wording).
_LLAMACPP_CONTEXT = re.compile(
    r"\((\d+) tokens\) exceeds the available context size \((\d+) tokens"
)
_VLLM_CONTEXT = re.compile(
    r"maximum context length is (\d+) tokens.*?(?:requested|resulted in|at least) (\d+) tokens",
    re.DOTALL,
)
# A 5xx whose message says the request itself is wrong (llama.cpp answers 500 for an image
# sent to a text model and for tools it cannot parse) ...
_CLIENT_PHRASES = (
    "not supported",
    "unsupported",
    "failed to parse",
    "could not parse",
    "invalid tool",
    "invalid content",
    "invalid message",
    "invalid request",
    "roles must alternate",
)
# A 5xx about the model's own output (llama.cpp's tool-call parser: "... does not match
# the expected peg-native format"): not the client's fault, not the backend's either.
_OUTPUT_PHRASES = ("does not match the expected", "failed to parse the model output")
MODEL_OUTPUT_INVALID = "model_output_invalid"
# ... unless it speaks of the machine: those are faults whatever else they say.
_FAULT_PHRASES = ("cuda", "out of memory", "nccl", "device", "tensor", "enginedead", "engine core")
# Request fields an engine's message may name (quoted, or first word), and what OpenAI
# calls the field where the engine calls it something else.
_PARAMS = frozenset(
    {
        "messages", "prompt", "input", "model", "tools", "tool_choice", "temperature",
        "top_p", "n", "max_tokens", "max_completion_tokens", "stop", "stream",
        "stream_options", "response_format", "logprobs", "top_logprobs", "logit_bias",
        "presence_penalty", "frequency_penalty", "seed", "user", "functions",
        "function_call", "parallel_tool_calls", "dimensions", "encoding_format", "echo",
        "suffix", "best_of", "content", "modalities", "reasoning_effort",
    }
)  # fmt: skip
_QUOTED = re.compile(r"""['"`]([a-z_]+)(?:\[\])?['"`]""")
_FIRST_WORD = re.compile(r"([a-z_]+)(?:\[\])?\b")
_NAMED = re.compile(r"""\b(?:param(?:eter)?|field)s?:? ['"`]?([a-z_]+)""")  # "Unsupported param: x"
_LOC = re.compile(r"""'loc': \('body', '([a-z_]+)'""")  # vLLM's str(RequestValidationError)
_PROMPT_PARAM: dict[Kind, str] = {
    "chat": "messages", "completions": "prompt", "embeddings": "input"
}  # fmt: skip


def engine_error(status: int, body: bytes, content_type: str, path: str) -> OpenAIError:
    """An engine's error answer as the gateway answers it (status, OpenAI's four fields)."""
    kind = KINDS.get(path, "chat")
    message, etype, param, code = _parse_error(body, content_type)
    if not message:
        message = f"The model backend answered HTTP {status}."
    lower = message.lower()
    if etype == "exceed_context_size_error" or any(p in lower for p in _CONTEXT_PHRASES):
        limit, tokens = _context_counts(message)
        return context_length_exceeded(
            _param(param, kind) or _PROMPT_PARAM[kind], limit, tokens, message
        )
    if status in (401, 403):
        # The gateway's own credentials towards the engine were refused: the caller's key
        # was fine, so this is the backend's (its configuration's) fault, not theirs.
        return OpenAIError(502, f"The model backend refused the gateway: {message}",
                           "server_error", None, "upstream_auth_failed")  # fmt: skip
    client = status < 500 or (
        any(p in lower for p in _CLIENT_PHRASES) and not any(p in lower for p in _FAULT_PHRASES)
    )
    if etype == "not_supported_error" or status == 501:
        # llama.cpp: embeddings on a server started without them; the model cannot do it.
        return OpenAIError(400, message, "invalid_request_error", "model", "unsupported_model")
    if status >= 500 and any(p in lower for p in _OUTPUT_PHRASES):
        # The engine could not parse what the model generated (a tool call that does not
        # match the template's format): this answer failed, the backend is healthy.
        return OpenAIError(500, message, "server_error", None, MODEL_OUTPUT_INVALID)
    if not client:
        etype = "service_unavailable" if status == 503 else "server_error"
        return OpenAIError(status, message, etype, None, _string_code(code))
    status = 400 if status >= 500 or status == 422 else status
    if status == 404 and lower in ("not found", "404: not found"):
        # FastAPI/aiohttp's bare 404 for a path the engine does not serve for this model
        # (vLLM registers /v1/embeddings only for embedding models).
        return OpenAIError(400, f"The model does not support {path}.",
                           "invalid_request_error", "model", "unsupported_model")  # fmt: skip
    param = _param(param, kind) or _guess_param(lower, kind)
    if status == 404 and "model" in lower:
        param, code = "model", "model_not_found"
    return OpenAIError(status, message, _type_for(status), param, _string_code(code))


def _context_counts(message: str) -> tuple[int | None, int | None]:
    """(context limit, prompt tokens) from an engine's context-overflow message."""
    m = _LLAMACPP_CONTEXT.search(message)
    if m is not None:
        return int(m.group(2)), int(m.group(1))
    m = _VLLM_CONTEXT.search(message)
    if m is not None:
        return int(m.group(1)), int(m.group(2))
    return None, None


def is_backend_fault(err: OpenAIError) -> bool:
    """M5: only a backend's own fault ejects it; a client's mistake (4xx) never does, nor
    a model's output the engine could not parse (the next request may well succeed)."""
    return err.status >= 500 and err.code != MODEL_OUTPUT_INVALID


def _parse_error(body: bytes, content_type: str) -> tuple[str, str, str | None, object]:
    """(message, engine's type, engine's param, engine's code) from any known error body."""
    text = body.decode("utf-8", "replace").strip()
    if "json" not in content_type and not text.startswith(("{", "[")):
        if "html" in content_type or text.startswith("<"):
            return "", "", None, None  # an HTML error page says nothing a client can use
        return text[:_MAX_MESSAGE], "", None, None
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return text[:_MAX_MESSAGE], "", None, None
    if not isinstance(obj, dict):
        return text[:_MAX_MESSAGE], "", None, None
    err = obj.get("error")
    if isinstance(err, dict):  # llama.cpp, vLLM, OpenAI itself
        obj = err
    elif isinstance(err, str) and "message" not in obj:  # {"error": "text"}
        return err[:_MAX_MESSAGE], "", None, None
    detail = obj.get("detail")
    if "message" not in obj and detail is not None:  # FastAPI
        return _fastapi_detail(detail)
    message = obj.get("message")
    etype = obj.get("type")
    param = obj.get("param")
    return (
        str(message)[:_MAX_MESSAGE] if message is not None else "",
        etype if isinstance(etype, str) else "",
        param if isinstance(param, str) else None,
        obj.get("code"),
    )


def _fastapi_detail(detail: object) -> tuple[str, str, str | None, object]:
    """FastAPI's 422: ``{"detail": [{"loc": ["body", "messages", 0], "msg", "type"}]}``."""
    if not isinstance(detail, list) or not detail or not isinstance(detail[0], dict):
        return str(detail)[:_MAX_MESSAGE], "", None, None
    first = detail[0]
    loc = [p for p in first.get("loc", ()) if p not in ("body", "query")]
    param = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc) or None
    msg = str(first.get("msg", "Invalid request"))
    kind = str(first.get("type", ""))
    code = (
        "missing_required_parameter"
        if kind == "missing"
        else "invalid_type"
        if kind.endswith(("_type", "_parsing"))
        else "invalid_value"
    )
    message = f"{msg}: '{param}'" if param else msg
    return message[:_MAX_MESSAGE], "", param, code


def _param(param: str | None, kind: Kind) -> str | None:
    """The engine's own ``param`` when it names a request field (vLLM's "input_tokens"
    does not), under OpenAI's name for it."""
    if param is None:
        return None
    head = param.split(".", 1)[0].split("[", 1)[0]
    if head not in _PARAMS:
        return None
    return _alias(head, kind) if head == param else param


def _guess_param(lower: str, kind: Kind) -> str | None:
    """The request field an engine's message is about: a quoted field name, a field name
    that starts the message, or what the words point at (images are in messages)."""
    quoted = [m.group(1) for m in _QUOTED.finditer(lower)]
    named = [m.group(1) for m in _NAMED.finditer(lower)]
    loc = _LOC.search(lower)
    first = _FIRST_WORD.match(lower)
    for name in (*quoted, *named, loc and loc.group(1), first and first.group(1)):
        if name in _PARAMS:
            return _alias(name, kind)
    if "tool" in lower:
        return "tools"
    if kind == "chat" and any(w in lower for w in ("image", "audio", "content", "role")):
        return "messages"
    return None


def _alias(name: str, kind: Kind) -> str:
    if name == "content":
        return "messages"
    if name == "prompt" and kind != "completions":
        return _PROMPT_PARAM[kind]  # llama.cpp calls every input "prompt"
    return name


def _type_for(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if status < 500 else "server_error"


def _string_code(code: object) -> str | None:
    """OpenAI's ``code`` is a string or null; engines put the HTTP status there."""
    return code if isinstance(code, str) and code else None
