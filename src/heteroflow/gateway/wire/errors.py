"""OpenAI-shaped error responses of the gateway, and the ASGI type aliases it uses.

Every error the gateway itself produces has OpenAI's body shape
``{"error": {"message", "type", "param", "code"}}`` so that the official SDKs map it
to their exception classes (401 -> ``AuthenticationError``, 404 -> ``NotFoundError``,
...). Errors that come from a backend are relayed untouched and never pass through here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any

import orjson

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

JSON_CONTENT_TYPE = (b"content-type", b"application/json")


@dataclass(frozen=True, slots=True)
class OpenAIError:
    """One error response: HTTP status plus the four fields of OpenAI's error object."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


async def send_json(
    send: Send,
    status: int,
    body: bytes,
    extra_headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    """Send a complete JSON response in two ASGI messages."""
    headers = [JSON_CONTENT_TYPE, (b"content-length", str(len(body)).encode()), *extra_headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(
    send: Send, err: OpenAIError, extra_headers: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    await send_json(send, err.status, err.body(), extra_headers)


def invalid_api_key(*, missing: bool) -> OpenAIError:
    # The key itself is never echoed back (OpenAI shows a masked prefix; we show nothing).
    message = (
        "You didn't provide an API key. Provide it in the Authorization header "
        "(Authorization: Bearer YOUR_KEY)."
        if missing
        else "Incorrect API key provided."
    )
    return OpenAIError(401, message, "invalid_request_error", None, "invalid_api_key")


def invalid_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, None)


def context_length_exceeded(
    param: str, limit: int | None, tokens: int | None, detail: str = ""
) -> OpenAIError:
    """The input does not fit the model's context: OpenAI's current wording (which
    LangChain's ``ContextOverflowError`` and LiteLLM's ``ContextWindowExceededError``
    recognise), whoever found it: the gateway's estimate or the engine's own count."""
    if limit is not None and tokens is not None:
        message = (
            f"Input tokens exceed the configured limit of {limit} tokens. Your messages "
            f"resulted in {tokens} tokens. Please reduce the length of the messages."
        )
    else:
        message = "Input tokens exceed the configured limit of the model's context window."
    if detail:
        message += f" ({detail})"
    return OpenAIError(400, message, "invalid_request_error", param, "context_length_exceeded")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        None,
        "model_not_found",
    )


def no_healthy_backend(model: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"No healthy backend is available for model `{model}`. Please retry later.",
        "service_unavailable",
        None,
        "no_healthy_backend",
    )


def model_waking(model: str, retry_after_s: int, *, held_s: float | None = None) -> OpenAIError:
    """F6: the model is asleep and a wake is under way (held off, or held too long)."""
    if held_s is None:
        message = (
            f"The model `{model}` is asleep and is being woken up. "
            f"Please retry in {retry_after_s} s."
        )
    else:
        message = (
            f"The model `{model}` is waking up but was not ready within {held_s:g} s. "
            f"Please retry in {retry_after_s} s."
        )
    return OpenAIError(503, message, "service_unavailable", None, "model_waking")


def model_starting(
    model: str, retry_after_s: int, replicas: int, for_s: float, *, held_s: float | None = None
) -> OpenAIError:
    """M17: the model's replicas are starting and none is up yet (held off, or held too
    long); ``for_s``: how long the longest-waiting one has been on its way up."""
    what = "1 replica" if replicas == 1 else f"{replicas} replicas"
    since = f" (for {for_s:.0f} s)" if for_s > 0 else ""
    held = "" if held_s is None else f" and none was ready within {held_s:g} s"
    return OpenAIError(
        503,
        f"The model `{model}` has {what} starting{since}{held}. "
        f"Please retry in {retry_after_s} s.",
        "service_unavailable",
        None,
        "model_starting",
    )


def model_unavailable(model: str, why: str) -> OpenAIError:
    """F6: the model is asleep and cannot be woken now; ``why`` is the server's reason."""
    return OpenAIError(
        503,
        f"The model `{model}` is asleep and cannot be woken now: {why}",
        "service_unavailable",
        None,
        "model_unavailable",
    )


def wake_failed(model: str, why: str) -> OpenAIError:
    """F6: the gateway could not ask for the wake (the server is away, ...)."""
    return OpenAIError(
        503,
        f"The model `{model}` is asleep and could not be woken: {why}. Please retry later.",
        "service_unavailable",
        None,
        "wake_failed",
    )


def upstream_error() -> OpenAIError:
    return OpenAIError(
        502,
        "The model backend could not be reached or failed.",
        "server_error",
        None,
        "upstream_error",
    )


def upstream_timeout() -> OpenAIError:
    return OpenAIError(
        504,
        "The model backend did not answer in time.",
        "server_error",
        None,
        "upstream_timeout",
    )


def payload_too_large(limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"Request body is larger than {limit} bytes.", "invalid_request_error", None, None
    )


def invalid_url(method: str, path: str) -> OpenAIError:
    # Same wording as OpenAI's answer for an unknown path.
    return OpenAIError(404, f"Invalid URL ({method} {path})", "invalid_request_error", None, None)


def method_not_allowed(method: str, path: str) -> OpenAIError:
    return OpenAIError(
        405, f"Method {method} is not allowed for {path}.", "invalid_request_error", None, None
    )
