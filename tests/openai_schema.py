"""OpenAI's published response schema, checked strictly (issue 15, M13): raw JSON answers
against the response types the ``openai`` package ships.

The SDK's pydantic models are lenient on purpose: every model allows extra keys, and a
missing key never fails parsing (``construct`` fills in what is there). A server that
leaves out what OpenAI's schema requires still "works" with the Python SDK — and breaks
typed clients elsewhere (the Node SDK's types, Go, Java, schema validators). So
:func:`assert_conforms` walks the pydantic fields of the SDK type over the raw JSON:

- every field without a default must be present (``id``, ``choices``, ``created`` ...);
- every field the published schema marks required *and nullable* must be present too,
  even though the Python type says ``Optional[X] = None`` and cannot tell it from an
  optional one (``NULLABLE_REQUIRED``; taken from the same schema as the Node SDK's
  ``.d.ts`` files, where they read ``logprobs: Logprobs | null`` rather than
  ``logprobs?: ...``);
- every value present has the field's type: literals are one of their values, ``int``
  is an integer (never a bool, never a float), ``str`` is a string, lists and dicts hold
  the right items, and a union is satisfied by one of its members;
- then ``model_validate(strict=True)``, pydantic's own strict mode, must accept it.

Keys the type does not know are allowed, as OpenAI's SDKs allow them (llama.cpp adds
``timings``).
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, Union

import openai
from openai.types import Completion, CompletionChoice, CreateEmbeddingResponse, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.shared import ErrorObject


class ErrorResponse(openai.BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorObject


class ModelList(openai.BaseModel):
    """The body of ``GET /v1/models``."""

    object: Literal["list"]
    data: list[Model]


class CompletionChunkChoice(CompletionChoice):
    """A streamed legacy completion's choice: OpenAI sends ``finish_reason: null`` until
    the last chunk, though the SDK parses chunks as ``Completion``, whose type has no null."""

    finish_reason: Literal["stop", "length", "content_filter"] | None  # type: ignore[assignment]


class CompletionChunk(Completion):
    """One ``data:`` event of a streamed ``/v1/completions``."""

    choices: list[CompletionChunkChoice]  # type: ignore[assignment]


# Required by OpenAI's published schema but nullable, so ``Optional[...] = None`` in the
# Python types: these keys must be present, with null when there is nothing to say.
NULLABLE_REQUIRED: dict[type[openai.BaseModel], frozenset[str]] = {
    ChatChoice: frozenset({"logprobs"}),
    ChatCompletionMessage: frozenset({"content", "refusal"}),
    CompletionChoice: frozenset({"logprobs"}),
    CompletionChunkChoice: frozenset({"logprobs"}),
    ErrorObject: frozenset({"code", "param"}),
}

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "Completion",
    "CompletionChunk",
    "CreateEmbeddingResponse",
    "ErrorResponse",
    "Model",
    "ModelList",
    "assert_conforms",
    "conformance_errors",
    "conforms",
]

# ``object`` -> the type an answer carrying it must conform to (``conforms``).
_BY_OBJECT: dict[str, type[openai.BaseModel]] = {
    "chat.completion": ChatCompletion,
    "chat.completion.chunk": ChatCompletionChunk,
    "text_completion": Completion,
    "list": CreateEmbeddingResponse,
    "model": Model,
}


def conforms(obj: dict[str, Any]) -> None:
    """``assert_conforms`` with the type its ``object`` names, plus what the types
    cannot say: ids with OpenAI's prefixes, a model's ``created`` a real time."""
    kind = obj["object"]
    streamed = kind == "text_completion" and any(
        c.get("finish_reason") is None for c in obj["choices"]
    )
    assert_conforms(obj, CompletionChunk if streamed else _BY_OBJECT[kind])
    if kind == "model":
        assert obj["created"] > 0, "a model's created is a real time"
    elif kind in ("chat.completion", "text_completion"):
        assert obj["id"].startswith("chatcmpl-" if kind == "chat.completion" else "cmpl-")


def assert_conforms(raw: object, model: type[openai.BaseModel]) -> None:
    """Fail with every deviation of ``raw`` (parsed JSON) from ``model``, path by path."""
    problems = conformance_errors(raw, model)
    assert not problems, f"{model.__name__} does not conform:\n  " + "\n  ".join(problems)


def conformance_errors(raw: object, model: type[openai.BaseModel]) -> list[str]:
    """Every deviation of ``raw`` from ``model`` (empty when it conforms)."""
    problems = _check(raw, model, "$")
    if not problems:
        try:
            model.model_validate(raw, strict=True)
        except Exception as exc:  # pydantic's ValidationError, or a strict-mode refusal
            problems.append(f"$: strict validation failed: {exc}")
    return problems


def _check(value: object, annotation: Any, path: str) -> list[str]:
    if annotation is Any or annotation is object:
        return []
    if isinstance(annotation, type) and issubclass(annotation, openai.BaseModel):
        return _check_model(value, annotation, path)
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Annotated:
        return _check(value, args[0], path)
    if origin is Literal:
        return [] if value in args else [f"{path}: {value!r} is not one of {list(args)}"]
    if origin is Union or origin is types.UnionType:
        if value is None and type(None) in args:
            return []
        tries = [_check(value, arg, path) for arg in args if arg is not type(None)]
        if any(not t for t in tries):
            return []
        if len(tries) == 1:  # Optional[X]: what X found wrong says more
            return tries[0]
        return [f"{path}: {_short(value)} matches none of {[_name(a) for a in args]}"]
    if origin in (list, typing.List):  # noqa: UP006 (what the SDK's types say)
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {_short(value)}"]
        item = args[0] if args else Any
        return [p for i, v in enumerate(value) for p in _check(v, item, f"{path}[{i}]")]
    if origin in (dict, typing.Dict, Mapping):  # noqa: UP006
        if not isinstance(value, dict):
            return [f"{path}: expected an object, got {_short(value)}"]
        item = args[1] if len(args) == 2 else Any
        return [p for k, v in value.items() for p in _check(v, item, f"{path}.{k}")]
    return _check_scalar(value, annotation, path)


def _check_scalar(value: object, annotation: Any, path: str) -> list[str]:
    if annotation is type(None):
        ok = value is None
    elif annotation is bool:
        ok = isinstance(value, bool)
    elif annotation is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif annotation is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif annotation is str:
        ok = isinstance(value, str)
    else:  # a type this checker does not know: pydantic's strict pass judges it
        return []
    return [] if ok else [f"{path}: expected {_name(annotation)}, got {_short(value)}"]


def _check_model(value: object, model: type[openai.BaseModel], path: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{path}: expected a {model.__name__} object, got {_short(value)}"]
    problems: list[str] = []
    must = NULLABLE_REQUIRED.get(model, frozenset())
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key not in value:
            if info.is_required() or name in must:
                problems.append(f"{path}.{key}: required by {model.__name__}, missing")
            continue
        problems += _check(value[key], info.annotation, f"{path}.{key}")
    return problems


def _name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or repr(annotation)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
