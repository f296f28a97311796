"""HTTP conventions of every ``/v1`` answer (issue 15, item 6): request ids, CORS,
stream headers and compressed request bodies.

* ``x-request-id`` on every answer, errors and ``/v1/models`` included: the caller's own
  when it sent a usable one (printable ASCII, at most 128 characters), else a new
  ``req_<32 hex>``. The same id goes upstream (``upstream.REQUEST_ID_HEADER``) so an
  engine's log lines can be matched with the client's (the OpenAI SDKs expose it as
  ``response._request_id``). The rule is the management API's too (``logs.request_id``),
  and the id is in ``logs.REQUEST_ID`` while the request is answered (its log lines).
* CORS, off unless origins are configured (``gateway_cors_origins``; ``*`` = any). A
  preflight (``OPTIONS`` with ``Access-Control-Request-Method``) from an allowed origin
  is answered 204 on any ``/v1`` path with the methods, the headers it asked for and a
  max-age; other answers to an allowed origin carry ``Access-Control-Allow-Origin`` and
  expose the request id and rate-limit headers. No credentials mode: browsers send the
  API key as a bearer header, never as a cookie. With CORS off, or an origin not in the
  list, ``OPTIONS`` on a known path is a plain 204 with ``Allow`` and no
  ``Access-Control-*`` header, so a browser blocks the call with its own CORS message
  (a 405 would read as a gateway bug).
* Streams are sent with ``cache-control: no-cache`` and ``x-accel-buffering: no`` (so a
  proxy such as nginx does not hold events back), whatever the engine said.
* A ``gzip`` or ``deflate`` request body (``Content-Encoding``) is decompressed with the
  size limit applied to the decompressed size, never inflating past it (a zip bomb costs
  at most the limit); another encoding is a 415 naming it.

The policies are plain functions and a ``Cors`` value built once from the settings; the
only I/O here is ``answer_options`` (one ASGI response).
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, MutableMapping
from typing import Any

from heteroflow.gateway.wire import errors
from heteroflow.logs import new_request_id as new_request_id
from heteroflow.logs import request_id as request_id

Headers = list[tuple[bytes, bytes]]

REQUEST_ID_KEY = "heteroflow.request_id"  # the request id in the ASGI scope, for upstream
REQUEST_ID_HEADER = b"x-request-id"
STREAM_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
)
# What a browser app may read of an answer (besides the CORS-safelisted ones).
EXPOSED_HEADERS = (
    b"x-request-id, x-ratelimit-limit-requests, x-ratelimit-limit-tokens, "
    b"x-ratelimit-remaining-requests, x-ratelimit-remaining-tokens, "
    b"x-ratelimit-reset-requests, x-ratelimit-reset-tokens, retry-after, retry-after-ms, "
    b"idempotent-replayed, x-heteroflow-auto-model"
)
# Allowed when a preflight does not list the headers it wants: what the OpenAI SDKs send.
DEFAULT_ALLOWED_HEADERS = (
    b"authorization, content-type, content-encoding, x-request-id, idempotency-key, "
    b"x-session-id, x-heteroflow-capabilities, openai-organization, openai-project, "
    b"openai-beta, x-stainless-arch, x-stainless-lang, x-stainless-os, "
    b"x-stainless-package-version, x-stainless-retry-count, x-stainless-runtime, "
    b"x-stainless-runtime-version, x-stainless-timeout"
)
ALLOWED_METHODS = b"GET, POST, OPTIONS"
PREFLIGHT_MAX_AGE_S = b"7200"  # Chromium's cap; Firefox allows a day
_TOKEN_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
_ENCODINGS = {b"gzip": 16 + zlib.MAX_WBITS, b"x-gzip": 16 + zlib.MAX_WBITS, b"deflate": 0}


def stream_headers(headers: Headers) -> Headers:
    """An SSE answer's headers: the engine's cache-control replaced by ours."""
    return [h for h in headers if h[0] != b"cache-control"] + list(STREAM_HEADERS)


class Cors:
    """Which browser origins may call ``/v1``: none (off), a list, or any (``*``)."""

    __slots__ = ("_any", "_origins")

    def __init__(self, origins: Iterable[str]) -> None:
        listed = [o.strip().rstrip("/") for o in origins if o.strip()]
        self._any = "*" in listed
        self._origins = frozenset(o.encode("latin-1") for o in listed if o != "*")

    @property
    def enabled(self) -> bool:
        return self._any or bool(self._origins)

    def _allowed(self, origin: bytes | None) -> bytes | None:
        """The ``Access-Control-Allow-Origin`` value for ``origin``; None: not allowed."""
        if origin is None:
            return None
        if self._any:
            return b"*"
        return origin if origin in self._origins else None

    def answer_headers(self, origin: bytes | None) -> Headers:
        """The CORS headers of an ordinary (non-preflight) answer."""
        if not self.enabled:
            return []
        allowed = self._allowed(origin)
        # a list of origins makes the answer depend on Origin: caches must know
        out: Headers = [] if self._any else [(b"vary", b"Origin")]
        if allowed is not None:
            out.append((b"access-control-allow-origin", allowed))
            out.append((b"access-control-expose-headers", EXPOSED_HEADERS))
        return out

    def preflight_headers(self, origin: bytes | None, requested: bytes | None) -> Headers | None:
        """What a preflight's answer adds to ``answer_headers``, or None when the origin
        may not call (or CORS is off). The headers it asks for are allowed as asked (an
        OpenAI SDK adds ``x-stainless-*`` ones as it pleases) when they are well-formed
        names, else the ones the SDKs send."""
        if not self.enabled or self._allowed(origin) is None:
            return None
        headers = DEFAULT_ALLOWED_HEADERS
        if requested is not None and _header_list(requested):
            headers = requested
        return [
            (b"access-control-allow-methods", ALLOWED_METHODS),
            (b"access-control-allow-headers", headers),
            (b"access-control-max-age", PREFLIGHT_MAX_AGE_S),
        ]


def _header_list(value: bytes) -> bool:
    names = [n.strip() for n in value.split(b",")]
    return all(n and _TOKEN_CHARS.issuperset(n) for n in names)


class Conventions:
    """Applied to every ``/v1`` request by ``GatewayApp``: its id, and the headers every
    answer to it carries."""

    __slots__ = ("cors",)

    def __init__(self, cors_origins: Iterable[str] = ()) -> None:
        self.cors = Cors(cors_origins)

    def begin(self, scope: MutableMapping[str, Any]) -> Headers:
        """The request's id (kept in the scope for upstream) and its answer's headers."""
        sent = origin = None
        for name, value in scope["headers"]:
            if name == REQUEST_ID_HEADER:
                sent = value
            elif name == b"origin":
                origin = value
        rid = request_id(sent)
        scope[REQUEST_ID_KEY] = rid
        headers: Headers = [(REQUEST_ID_HEADER, rid.encode("ascii"))]
        if origin is not None or self.cors.enabled:
            headers += self.cors.answer_headers(origin)
        return headers

    async def answer_options(
        self, scope: MutableMapping[str, Any], send: errors.Send, allow: bytes | None
    ) -> bool:
        """Answer ``OPTIONS`` for a path that takes ``allow`` (None: unknown path), through
        a ``send`` that adds ``begin``'s headers (the allowed origin among them).

        A preflight from an allowed origin: 204 with the CORS headers, on any path (the
        call that follows then gets an error the page can read). Else a known path's
        ``Allow``, 204. False when not answered (an unknown path: the caller's 404)."""
        origin = requested = None
        preflight = False
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = value
            elif name == b"access-control-request-method":
                preflight = True
            elif name == b"access-control-request-headers":
                requested = value
        cors = self.cors.preflight_headers(origin, requested) if preflight else None
        if cors is None and allow is None:
            return False
        headers = [(b"allow", (allow or ALLOWED_METHODS) + b", OPTIONS"), *(cors or ())]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
        return True


def decode_body(raw: bytes, content_encoding: bytes, limit: int) -> bytes | errors.OpenAIError:
    """``raw`` decoded as its ``Content-Encoding`` says (encodings applied in the order
    listed, so undone in reverse): the body, or the error to answer (415 for an encoding
    we do not take, 413 past ``limit`` decoded bytes, 400 for a corrupt body)."""
    codings = [c.strip().lower() for c in content_encoding.split(b",")]
    body = raw
    for coding in reversed(codings):
        if coding in (b"identity", b""):
            continue
        wbits = _ENCODINGS.get(coding)
        if wbits is None:
            return unsupported_encoding(coding.decode("latin-1"))
        try:
            body = _inflate(body, wbits, limit)
        except _TooLarge:
            return errors.payload_too_large(limit)
        except zlib.error:
            return errors.invalid_request(
                f"The request body could not be decoded as {coding.decode('latin-1')} "
                "(Content-Encoding header)."
            )
    return body


class _TooLarge(Exception):
    pass


def _inflate(data: bytes, wbits: int, limit: int) -> bytes:
    """Decompress at most ``limit`` bytes; gzip may hold several members."""
    if wbits == 0:  # deflate: RFC 9110's zlib stream, or the raw deflate some clients send
        wbits = zlib.MAX_WBITS if _zlib_header(data) else -zlib.MAX_WBITS
    out: list[bytes] = []
    size = 0
    while True:
        d = zlib.decompressobj(wbits)
        chunk = d.decompress(data, limit - size + 1)  # never more than one byte past
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        out.append(chunk)
        if not d.eof:
            raise zlib.error("truncated or over-long stream")
        data = d.unused_data
        if not data or wbits != 16 + zlib.MAX_WBITS:
            if data:
                raise zlib.error("trailing data")
            return b"".join(out)


def _zlib_header(data: bytes) -> bool:
    """RFC 1950's two header bytes: method 8 (deflate) and a valid check value."""
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


def unsupported_encoding(coding: str) -> errors.OpenAIError:
    return errors.OpenAIError(
        415,
        f"Content-Encoding '{coding}' is not supported: send the body as is, "
        "or compressed with gzip or deflate.",
        "invalid_request_error",
        None,
        "unsupported_content_encoding",
    )
