"""The OpenAI-compatible gateway: a raw ASGI3 app for the ``/v1`` paths.

Owns the request path of inference traffic: API-key check against the routing snapshot,
model access check, backend choice (``balancing``), model-name remap to the backend's own
model id, and a byte relay of the backend's answer (SSE chunk by chunk). No framework sits
on this path, and nothing here logs per request at INFO, because the gateway's CPU cost per
request is its throughput limit (see bench/gateway: a bare relay costs ~0.2 ms/request).

Paths: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``POST /v1/embeddings``,
``GET /v1/models`` and ``GET /v1/models/{id}``. Anything else under ``/v1`` is an
OpenAI-shaped 404 (or 405 for a known path with the wrong method).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import aiohttp
import orjson

from heteroflow.gateway import errors
from heteroflow.gateway.balancing import Balancer
from heteroflow.gateway.errors import Receive, Scope, Send
from heteroflow.gateway.health import DEFAULT_COOLDOWN_S, PassiveHealth
from heteroflow.gateway.snapshot import KeyEntry, RoutingSnapshot, SnapshotHolder
from heteroflow.gateway.upstream import Upstream

logger = logging.getLogger(__name__)

_INFERENCE_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings"})
_MODELS_PREFIX = "/v1/models/"
MAX_BODY_BYTES = 64 * 1024 * 1024
# Backend response headers passed on to the client; hop-by-hop and framing headers are
# the server's business (uvicorn sets content-length or chunked itself).
_RELAYED_HEADERS = (b"content-type", b"content-encoding", b"cache-control")
_SSE_ERROR_CODE = "upstream_error"


class _BodyTooLarge(Exception):
    pass


class _Watch:
    """Shared between a proxied request and its disconnect watcher."""

    __slots__ = ("disconnected", "finished")

    def __init__(self) -> None:
        self.finished = False  # the final body message is being sent: nothing to cancel
        self.disconnected = False


class GatewayApp:
    """ASGI3 callable for ``/v1``; mount it before any other app for that prefix."""

    def __init__(
        self,
        holder: SnapshotHolder,
        *,
        models_cache_ttl_s: float = 30.0,
        upstream_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        eject_cooldown_s: float = DEFAULT_COOLDOWN_S,
        max_sessions: int = 10_000,
    ) -> None:
        self._holder = holder
        self._health = PassiveHealth(eject_cooldown_s)
        self._balancer = Balancer(self._health, max_sessions=max_sessions)
        self._upstream = Upstream(
            models_cache_ttl_s=models_cache_ttl_s,
            upstream_timeout_s=upstream_timeout_s,
            connect_timeout_s=connect_timeout_s,
        )
        self._seen_version: int | None = None

    async def aclose(self) -> None:
        """Close the upstream connection pool(s)."""
        await self._upstream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            method: str = scope["method"]
            if path in _INFERENCE_PATHS:
                if method == "POST":
                    await self._proxy(scope, receive, send, path)
                else:
                    await _not_allowed(send, method, path, b"POST")
            elif path == "/v1/models" or path.startswith(_MODELS_PREFIX):
                if method == "GET":
                    await self._list_models(scope, send, path)
                else:
                    await _not_allowed(send, method, path, b"GET")
            else:
                await errors.send_error(send, errors.invalid_url(method, path))
        elif kind == "lifespan":
            await self._lifespan(receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _list_models(self, scope: Scope, send: Send, path: str) -> None:
        snap = self._holder.current
        entry = _authenticate(scope, snap)
        if isinstance(entry, errors.OpenAIError):
            await errors.send_error(send, entry)
            return
        # Only what the key may call *and* what has a route: a listed model must not
        # answer model_not_found when called.
        callable_ = sorted(m for m in entry.models if (entry.tenant_id, m) in snap.routes)
        if path == "/v1/models":
            body = orjson.dumps({"object": "list", "data": [_model_object(m) for m in callable_]})
        else:
            model = path[len(_MODELS_PREFIX) :]
            if model not in callable_:
                await errors.send_error(send, errors.model_not_found(model))
                return
            body = orjson.dumps(_model_object(model))
        await errors.send_json(send, 200, body)

    async def _proxy(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        snap = self._holder.current
        entry = _authenticate(scope, snap)
        if isinstance(entry, errors.OpenAIError):
            await errors.send_error(send, entry)
            return
        try:
            raw = await _read_body(receive)
        except _BodyTooLarge:
            await errors.send_error(send, errors.payload_too_large(MAX_BODY_BYTES))
            return
        if raw is None:  # the client left before sending its body
            return
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await errors.send_error(
                send,
                errors.invalid_request(
                    "We could not parse the JSON body of your request. The body must be valid JSON."
                ),
            )
            return
        if not isinstance(body, dict):
            await errors.send_error(
                send, errors.invalid_request("The request body must be a JSON object.")
            )
            return
        model = body.get("model")
        if not isinstance(model, str):
            await errors.send_error(
                send, errors.invalid_request("You must provide a model parameter.", "model")
            )
            return
        targets = snap.routes.get((entry.tenant_id, model)) if model in entry.models else None
        if targets is None:
            await errors.send_error(send, errors.model_not_found(model))
            return
        # M4: X-Session-Id, else the body's ``user``, pins the session to a backend of
        # this route (scoped by tenant and model, so equal ids elsewhere do not collide).
        sid = _session_id(scope)
        if sid is None:
            user = body.get("user")
            if isinstance(user, str) and user:
                sid = user
        balancer = self._balancer
        backend = balancer.choose(targets, None if sid is None else (entry.tenant_id, model, sid))
        if backend is None:
            await errors.send_error(send, errors.no_healthy_backend(model))
            return
        if snap.version != self._seen_version:
            self._seen_version = snap.version
            self._upstream.retain(
                b.base_url for ts in snap.routes.values() for t in ts for b in t.backends
            )

        task = asyncio.current_task()
        assert task is not None
        watch = _Watch()
        # In flight from the choice until the answer ends, fails or the client leaves
        # (the ``finally`` below), so that least_connections sees streams as busy.
        balancer.acquire(backend)
        watcher = asyncio.create_task(_watch_disconnect(receive, task, watch))
        try:
            # M6: engines serve their model under their own id (often a path or a file
            # name); callers use the route's name. Rename only when the backend would not
            # know the requested name, and re-serialize only then.
            known = await self._upstream.model_ids(backend.base_url)
            if known is not None and known.first is not None and model not in known.ids:
                body["model"] = known.first
                raw = orjson.dumps(body)
            url = backend.base_url + path
            if scope.get("query_string"):
                url += "?" + scope["query_string"].decode("latin-1")
            resp = await self._upstream.open(url, raw, backend)
            if isinstance(resp, errors.OpenAIError):
                self._eject(backend.base_url)  # unreachable, reset or timed out
                watch.finished = True
                await errors.send_error(send, resp)
                return
            if resp.status >= 500:
                self._eject(backend.base_url)  # relayed as is; the next request goes elsewhere
            try:
                ok = await _relay(resp, send, watch, backend.base_url)
            except BaseException:
                resp.close()  # an unfinished answer: drop the connection, never pool it
                raise
            if not ok:
                self._eject(backend.base_url)
            resp.release()
        except asyncio.CancelledError:
            if watch.disconnected:
                # Our own cancellation (the client left): the upstream request is closed,
                # which tells the engine to stop generating. Nothing left to answer.
                task.uncancel()
                return
            raise
        finally:
            balancer.release(backend)
            watcher.cancel()

    def _eject(self, base_url: str) -> None:
        """M5: keep a failing backend out of selection for a cooldown (routing only)."""
        if self._health.eject(base_url):
            logger.warning(
                "backend %s: ejected from routing for %.1f s after a failure",
                base_url,
                self._health.cooldown_s,
            )


async def _relay(resp: aiohttp.ClientResponse, send: Send, watch: _Watch, base_url: str) -> bool:
    """Relay the backend's answer; False when reading it from the backend failed."""
    # ASGI wants lower-case header names; raw_headers keep the backend's spelling.
    headers = [(n.lower(), v) for n, v in resp.raw_headers if n.lower() in _RELAYED_HEADERS]
    ctype = resp.headers.get("Content-Type", "")
    if not ctype.startswith("text/event-stream"):
        try:
            data = await resp.read()
        except TimeoutError:
            watch.finished = True
            await errors.send_error(send, errors.upstream_timeout())
            return False
        except aiohttp.ClientError as exc:
            logger.warning(
                "backend %s: reading the answer failed: %s", base_url, type(exc).__name__
            )
            watch.finished = True
            await errors.send_error(send, errors.upstream_error())
            return False
        headers.append((b"content-length", str(len(data)).encode()))
        watch.finished = True
        await send({"type": "http.response.start", "status": resp.status, "headers": headers})
        await send({"type": "http.response.body", "body": data})
        return True
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    tail = b""
    try:
        async for chunk in resp.content.iter_any():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except (aiohttp.ClientError, TimeoutError) as exc:
        # Headers are gone already; an SSE error event is how OpenAI clients learn that
        # the stream broke (the SDK raises APIError on it) instead of a silent truncation.
        logger.warning("backend %s: stream broke: %s", base_url, type(exc).__name__)
        err = errors.OpenAIError(
            502,
            "The model backend's stream ended unexpectedly.",
            "server_error",
            None,
            _SSE_ERROR_CODE,
        )
        tail = b"data: " + err.body() + b"\n\n"
    watch.finished = True
    await send({"type": "http.response.body", "body": tail, "more_body": False})
    return not tail


async def _watch_disconnect(receive: Receive, task: asyncio.Task[object], watch: _Watch) -> None:
    # After the body is read, the only message left is http.disconnect (uvicorn also
    # sends it once the response is complete, hence the ``finished`` flag).
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            if not watch.finished:
                watch.disconnected = True
                task.cancel()
            return


def _authenticate(scope: Scope, snap: RoutingSnapshot) -> KeyEntry | errors.OpenAIError:
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


def _session_id(scope: Scope) -> str | None:
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


def _model_object(model: str) -> dict[str, object]:
    return {"id": model, "object": "model", "created": 0, "owned_by": "heteroflow"}


async def _not_allowed(send: Send, method: str, path: str, allow: bytes) -> None:
    await errors.send_error(send, errors.method_not_allowed(method, path), [(b"allow", allow)])
