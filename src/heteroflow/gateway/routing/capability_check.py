"""Refuses a request the model cannot answer (issue 15 item 2): a clear 400 naming the
field, before any engine sees it, instead of the engine's 500, 501 or silent plain text.

The model's capabilities travel on its route targets (``RouteTarget.capabilities``,
merged over the targets: absent only where every target lacks it). Only a capability
known absent refuses; unknown never does. Checks, cheapest first:

* ``/v1/embeddings`` on a model without embeddings -> ``param: model``;
* chat, completions or responses on an embeddings-only model -> ``param: model``;
* image parts (``image_url`` / ``input_image``) to a model without vision -> ``messages``;
* ``tools`` (unless ``tool_choice`` is ``"none"``) to a model without tool calling ->
  ``tools``;
* ``response_format`` ``json_schema`` / ``json_object`` without structured output ->
  ``response_format``;
* a prompt clearly longer than the context (characters / 4, which undercounts tokens for
  almost every tokenizer, so a refused prompt really is too long) -> code
  ``context_length_exceeded``, as OpenAI answers it;
* ``max_tokens`` (``max_completion_tokens``; ``max_output_tokens`` of a response) above
  the context -> ``param`` that field, code ``invalid_value``: no answer can be that long,
  and an engine that shifts its context (llama.cpp) would otherwise generate until the
  client leaves (issue 33: ``max_tokens: 1000000000`` ran for minutes).

A ``/v1/responses`` request arrives here already translated to its chat body
(``responses.to_chat``); only the ``param`` named follows the caller's path (``input``).

Pure: no I/O; a few dictionary reads per request when the model's capabilities are known,
one comparison when they are not.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from heteroflow.core.engines.capabilities import Capabilities, merge
from heteroflow.gateway.routing.auto import estimate_prompt_tokens
from heteroflow.gateway.wire.errors import OpenAIError, context_length_exceeded, invalid_request
from heteroflow.schemas.routing import RouteTarget

__all__ = ["refuse"]

EMBEDDINGS_PATH = "/v1/embeddings"
_GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
_IMAGE_PARTS = frozenset({"image_url", "input_image"})
_STRUCTURED = frozenset({"json_schema", "json_object"})
_PROMPT_PARAM = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}


def _has_image(items: object) -> bool:
    """Any image part in chat messages."""
    if not isinstance(items, list):
        return False
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list) and any(
            isinstance(part, dict) and part.get("type") in _IMAGE_PARTS for part in content
        ):
            return True
    return False


def _wants_tools(body: Mapping[str, Any]) -> bool:
    tools = body.get("tools") or body.get("functions")
    return bool(tools) and body.get("tool_choice") != "none"


def _wants_structure(body: Mapping[str, Any]) -> bool:
    fmt = body.get("response_format")
    return isinstance(fmt, dict) and fmt.get("type") in _STRUCTURED


def _too_long(path: str, body: Mapping[str, Any], model: str, limit: int) -> OpenAIError | None:
    tokens = estimate_prompt_tokens(body)
    if tokens <= limit:
        return None
    return context_length_exceeded(
        _PROMPT_PARAM.get(path, "input"), limit, tokens, "counted by the gateway's estimate"
    )


def _check(
    path: str, body: Mapping[str, Any], model: str, caps: Capabilities
) -> OpenAIError | None:
    if path == EMBEDDINGS_PATH:
        if caps.embeddings is False:
            return invalid_request(f"model '{model}' does not support embeddings", "model")
    elif path in _GENERATION_PATHS:
        if caps.chat is False:
            return invalid_request(
                f"model '{model}' is an embeddings model; it does not support {path}", "model"
            )
        if caps.vision is False and _has_image(body.get("messages")):
            param = "input" if path == "/v1/responses" else "messages"
            return invalid_request(f"model '{model}' does not accept image input", param)
        if caps.tools is False and _wants_tools(body):
            return invalid_request(f"model '{model}' does not support tools", "tools")
        if caps.json_schema is False and _wants_structure(body):
            return invalid_request(
                f"model '{model}' does not support structured output", "response_format"
            )
    else:
        return None
    if caps.context_length is not None:
        return _too_long(path, body, model, caps.context_length) or _too_many(
            path, body, caps.context_length
        )
    return None


def _too_many(path: str, body: Mapping[str, Any], limit: int) -> OpenAIError | None:
    """``max_tokens`` above the context, as OpenAI answers a value out of range."""
    field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    wanted = body.get(field)
    if type(wanted) is not int or wanted <= limit:
        return None
    param = "max_output_tokens" if path == "/v1/responses" else field
    return OpenAIError(
        400,
        f"{param} is too large: {wanted}. This model's maximum context length is {limit} "
        "tokens, prompt included.",
        "invalid_request_error",
        param,
        "invalid_value",
    )


def refuse(
    path: str, body: Mapping[str, Any], model: str, targets: Sequence[RouteTarget]
) -> OpenAIError | None:
    """The 400 for a request ``model`` cannot answer, or None to let it through."""
    caps = merge([t.capabilities for t in targets]) if targets else None
    if caps is None or not caps.known:
        return None
    return _check(path, body, model, caps)
