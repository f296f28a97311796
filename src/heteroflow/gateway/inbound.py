"""The client's side of one inference request: who calls, what it sent, and how it is
answered.

``parse`` is the first step of ``GatewayApp._proxy``: the API key against the routing
snapshot, then a JSON object body with a model name in OpenAI's request shape for the
path (``requests``). ``Call`` carries the request through the later steps (``router``,
``admission``, ``forward``); ``Exchange`` is its ``send``, which notes what the metrics
and an idempotency record need. The header helpers scan the ASGI scope without building
a dict: the gateway's CPU time per request is its throughput limit.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import orjson

from heteroflow.gateway.policy.idempotency import Pending, Recorder
from heteroflow.gateway.policy.limits import Ticket
from heteroflow.gateway.shaping.requests import check as check_request
from heteroflow.gateway.shaping.responses import CHAT_PATH, to_chat
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Message, Receive, Scope, Send
from heteroflow.gateway.wire.http_conventions import decode_body
from heteroflow.schemas.routing import Backend, KeyEntry, RouteTarget, RoutingSnapshot

MAX_BODY_BYTES = 64 * 1024 * 1024


class _BodyTooLarge(Exception):
    pass


class Call:
    """One inference request as it goes through the steps of ``GatewayApp._proxy``."""

    __slots__ = (
        "backend", "body", "client_raw", "entry", "model", "pending", "pin", "raw", "responses",
        "snap", "targets", "ticket",
    )

    def __init__(
        self, snap: RoutingSnapshot, entry: KeyEntry, raw: bytes, body: dict[str, Any],
        model: str,
    ) -> None:
        self.snap = snap
        self.entry = entry
        self.client_raw = raw  # what an idempotency key's fingerprint covers (M9)
        self.raw = raw  # what is sent upstream (re-serialized when the body changes)
        self.body = body
        self.model = model
        self.targets: tuple[RouteTarget, ...] | None = None
        self.pin: tuple[str, str, str] | None = None
        self.backend: Backend | None = None
        self.pending: Pending | None = None
        self.ticket: Ticket | None = None
        self.responses: dict[str, Any] | None = None  # M14: the /v1/responses request


class Exchange:
    """The ``send`` of one inference request: notes the status and model for metrics."""

    __slots__ = ("extra_headers", "first_at", "model", "recorder", "send", "status")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.status = 0  # 0 until a response starts (the client left first)
        self.model = ""  # the routed model name, once the route is known
        # added to the response start: x-request-id and CORS (http_conventions), ...
        self.extra_headers = headers
        self.recorder: Recorder | None = None  # M9: keeps the answer for replays
        # issue 33: when the answer's first body bytes went out (time.monotonic(); 0: not
        # yet): the time to first token of a stream, the live series' TTFT
        self.first_at = 0.0

    async def __call__(self, msg: Message) -> None:
        if self.recorder is not None:
            self.recorder.observe(msg)  # before extra_headers: those are not replayed
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            if self.extra_headers:
                msg = {**msg, "headers": [*msg.get("headers", ()), *self.extra_headers]}
        elif not self.first_at and msg.get("body"):
            self.first_at = time.monotonic()
        await self.send(msg)


async def parse(
    snap: RoutingSnapshot, scope: Scope, receive: Receive, send: Exchange, path: str
) -> Call | None:
    """The key (against the snapshot) and a JSON object body with a model name, in
    OpenAI's request shape for ``path`` (``requests``)."""
    entry = authenticate(scope, snap)
    if isinstance(entry, errors.OpenAIError):
        await errors.send_error(send, entry)
        return None
    try:
        raw = await _read_body(receive)
    except _BodyTooLarge:
        await errors.send_error(send, errors.payload_too_large(MAX_BODY_BYTES))
        return None
    if raw is None:  # the client left before sending its body
        return None
    encoding = header(scope, b"content-encoding")
    if encoding is not None:  # gzip/deflate, limited to MAX_BODY_BYTES decoded
        decoded = decode_body(raw, encoding, MAX_BODY_BYTES)
        if isinstance(decoded, errors.OpenAIError):
            await errors.send_error(send, decoded)
            return None
        raw = decoded
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        await errors.send_error(
            send,
            errors.invalid_request(
                "We could not parse the JSON body of your request. The body must be valid JSON."
            ),
        )
        return None
    if not isinstance(body, dict):
        await errors.send_error(
            send, errors.invalid_request("The request body must be a JSON object.")
        )
        return None
    model = body.get("model")
    if not isinstance(model, str):
        await errors.send_error(
            send, errors.invalid_request("You must provide a model parameter.", "model")
        )
        return None
    bad = check_request(path, body)
    if bad is not None:
        await errors.send_error(send, bad)
        return None
    return Call(snap, entry, raw, body, model)


async def as_chat(call: Call, send: Send) -> bool:
    """M14: a ``/v1/responses`` request becomes the chat completions request that answers
    it (``responses.to_chat``), checked as one; False when it was refused here. The
    idempotency fingerprint keeps the client's own body."""
    chat = to_chat(call.body)
    if isinstance(chat, errors.OpenAIError):
        await errors.send_error(send, chat)
        return False
    bad = check_request(CHAT_PATH, chat)
    if bad is not None:
        await errors.send_error(send, bad)
        return False
    call.responses, call.body, call.raw = call.body, chat, orjson.dumps(chat)
    return True


async def disconnected(receive: Receive) -> None:
    """Returns when the client disconnects (the body was read: nothing else comes)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def authenticate(scope: Scope, snap: RoutingSnapshot) -> KeyEntry | errors.OpenAIError:
    for name, value in scope["headers"]:
        if name == b"authorization":
            if value[:7].lower() != b"bearer ":
                break
            key = value[7:].strip()
            if not key:
                break
            # Same digest as snapshot.hash_key() for the ASCII keys we issue, without a
            # str round trip.
            entry = snap.keys.get(hashlib.sha256(key).hexdigest())
            return entry if entry is not None else errors.invalid_api_key(missing=False)
    return errors.invalid_api_key(missing=True)


def header(scope: Scope, name: bytes) -> bytes | None:
    for n, value in scope["headers"]:
        if n == name:
            return bytes(value)
    return None


def session_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-session-id":
            return value.decode("latin-1") or None
    return None


async def _read_body(receive: Receive) -> bytes | None:
    msg = await receive()
    if msg["type"] != "http.request":
        return None
    body: bytes = msg.get("body", b"")
    size = len(body)
    if size > MAX_BODY_BYTES:
        raise _BodyTooLarge
    if not msg.get("more_body", False):
        return body
    parts = [body]
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunk: bytes = msg.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _BodyTooLarge
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts)
