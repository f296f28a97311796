"""Idempotency keys (M9): the first answer to a keyed request is replayed for 24 h.

A request carrying ``Idempotency-Key`` is scoped to its API key's endpoint. Its
fingerprint is sha256(path + body bytes). The store holds one record per (endpoint, key):

* no record: the request claims it (an in-flight record with a lease, so a crashed
  gateway cannot block the key for longer than the lease) and runs;
* in flight, same fingerprint: ``409`` (``idempotency_key_in_use``, ``retry-after: 1``;
  the OpenAI SDK retries 409 by itself);
* any record with another fingerprint: ``422`` (``idempotency_key_reused``);
* done: the stored answer (status, content headers, body) with
  ``idempotent-replayed: true``.

What is stored: the answer as the client received it — recorded from the ASGI messages,
so it is whatever the relay sent (for example without the usage chunk the client did not
ask for). Streamed answers are recorded the same way as they pass and replayed as one
``text/event-stream`` body: the SDK reads the same events. Not stored (the record is
released, so a retry runs again): an answer with status >= 500 or 408/409/429, a gateway
error (unreachable, timeout, rate limited), a stream that broke, a client that left
before the end, and an answer larger than ``MAX_STORED_BODY`` (recording stops at the
cap). A replay costs no rate limit: the key is checked before the limits.
"""

from __future__ import annotations

import hashlib
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Protocol

import orjson

from heteroflow.core.clock import Clock
from heteroflow.gateway.wire import errors
from heteroflow.gateway.wire.errors import Message, Send

HEADER = b"idempotency-key"
REPLAY_HEADER = (b"idempotent-replayed", b"true")
MAX_KEY_LEN = 255
TTL_S = 24 * 3600.0
MAX_STORED_BODY = 1024 * 1024
# Headers describing one delivery rather than the answer: never stored or replayed.
_NOT_STORED = frozenset({b"content-length", b"transfer-encoding", b"connection"})

# Claim kinds; the Redis script returns the same numbers.
PROCEED = 0
IN_FLIGHT = 1
MISMATCH = 2
REPLAY = 3


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes

    def pack(self) -> bytes:
        head = orjson.dumps(
            [self.status, [[n.decode("latin-1"), v.decode("latin-1")] for n, v in self.headers]]
        )
        return len(head).to_bytes(4, "big") + head + self.body

    @classmethod
    def unpack(cls, data: bytes) -> StoredResponse:
        n = int.from_bytes(data[:4], "big")
        status, headers = orjson.loads(data[4 : 4 + n])
        return cls(
            int(status),
            tuple((h.encode("latin-1"), v.encode("latin-1")) for h, v in headers),
            data[4 + n :],
        )


@dataclass(frozen=True, slots=True)
class Claim:
    kind: int
    token: bytes = b""  # identifies our in-flight record (release only our own)
    response: StoredResponse | None = None
    shared: bool = True  # False: decided by a local fallback (Redis unreachable)


def fingerprint(path: str, raw: bytes) -> bytes:
    h = hashlib.sha256(path.encode())
    h.update(b"\0")
    h.update(raw)
    return h.hexdigest().encode()


def new_token() -> bytes:
    return os.urandom(8).hex().encode()


class IdempotencyStore(Protocol):
    async def claim(
        self, endpoint_id: str, key: bytes, fp: bytes, lease_ms: int, now_ms: float
    ) -> Claim: ...

    async def complete(
        self,
        endpoint_id: str,
        key: bytes,
        fp: bytes,
        packed: bytes,
        ttl_ms: int,
        now_ms: float,
        shared: bool,
    ) -> None: ...

    async def release(
        self, endpoint_id: str, key: bytes, fp: bytes, token: bytes, shared: bool
    ) -> None: ...


@dataclass(slots=True)
class _Record:
    done: bool
    fp: bytes
    token: bytes
    payload: bytes
    expires_ms: float


class MemoryTable:
    """The single-instance record table: an LRU bounded in entries and stored bytes."""

    def __init__(self, max_entries: int = 10_000, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._records: OrderedDict[tuple[str, bytes], _Record] = OrderedDict()

    def __len__(self) -> int:
        return len(self._records)

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def claim(self, endpoint_id: str, key: bytes, fp: bytes, lease_ms: int, now_ms: float) -> Claim:
        k = (endpoint_id, key)
        rec = self._records.get(k)
        if rec is not None and rec.expires_ms <= now_ms:
            self._drop(k)
            rec = None
        if rec is None:
            token = new_token()
            self._put(k, _Record(False, fp, token, b"", now_ms + lease_ms))
            return Claim(PROCEED, token)
        self._records.move_to_end(k)
        if rec.fp != fp:
            return Claim(MISMATCH)
        if not rec.done:
            return Claim(IN_FLIGHT)
        return Claim(REPLAY, response=StoredResponse.unpack(rec.payload))

    def complete(
        self, endpoint_id: str, key: bytes, fp: bytes, packed: bytes, ttl_ms: int, now_ms: float
    ) -> None:
        k = (endpoint_id, key)
        self._drop(k)
        self._put(k, _Record(True, fp, b"", packed, now_ms + ttl_ms))

    def release(self, endpoint_id: str, key: bytes, fp: bytes, token: bytes) -> None:
        k = (endpoint_id, key)
        rec = self._records.get(k)
        if rec is not None and not rec.done and rec.token == token and rec.fp == fp:
            self._drop(k)

    def _put(self, k: tuple[str, bytes], rec: _Record) -> None:
        self._records[k] = rec
        self._bytes += len(rec.payload)
        # Oldest first; in-flight records are skipped (dropping one would let a duplicate
        # run), unless nothing else is left.
        budget = len(self._records)
        while (
            len(self._records) > self._max_entries or self._bytes > self._max_bytes
        ) and budget > 0:
            budget -= 1
            old_k, old = next(iter(self._records.items()))
            if old.done or budget == 0:
                self._drop(old_k)
            else:
                self._records.move_to_end(old_k)

    def _drop(self, k: tuple[str, bytes]) -> None:
        rec = self._records.pop(k, None)
        if rec is not None:
            self._bytes -= len(rec.payload)


class Recorder:
    """Records an answer from the ASGI messages sent for it (up to a size cap)."""

    __slots__ = ("_cap", "_parts", "_size", "complete", "headers", "overflow", "status")

    def __init__(self, cap: int = MAX_STORED_BODY) -> None:
        self._cap = cap
        self._parts: list[bytes] = []
        self._size = 0
        self.status = 0
        self.headers: tuple[tuple[bytes, bytes], ...] = ()
        self.complete = False
        self.overflow = False

    def observe(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            self.status = msg["status"]
            self.headers = tuple(h for h in msg.get("headers", ()) if h[0] not in _NOT_STORED)
        elif msg["type"] == "http.response.body":
            chunk: bytes = msg.get("body", b"")
            if chunk and not self.overflow:
                self._size += len(chunk)
                if self._size > self._cap:
                    self.overflow = True
                    self._parts.clear()
                else:
                    self._parts.append(chunk)
            if not msg.get("more_body", False):
                self.complete = True

    def stored(self) -> StoredResponse | None:
        """The answer to keep, or None when it must not be replayed."""
        if not self.complete or self.overflow or not _storable(self.status):
            return None
        return StoredResponse(self.status, self.headers, b"".join(self._parts))


def _storable(status: int) -> bool:
    # 5xx, and the 4xx that mean "try again later", leave the key free for a retry.
    return 200 <= status < 500 and status not in (408, 409, 429)


def invalid_key() -> errors.OpenAIError:
    return errors.OpenAIError(
        400,
        f"The Idempotency-Key header must be 1 to {MAX_KEY_LEN} characters long.",
        "invalid_request_error",
        None,
        "invalid_idempotency_key",
    )


def in_flight() -> errors.OpenAIError:
    return errors.OpenAIError(
        409,
        "A request with this Idempotency-Key is still being processed. "
        "Retry once it has completed to get its response.",
        "invalid_request_error",
        None,
        "idempotency_key_in_use",
    )


def mismatch() -> errors.OpenAIError:
    return errors.OpenAIError(
        422,
        "This Idempotency-Key was already used with a different request "
        "(keys can only be reused with the same path and body).",
        "invalid_request_error",
        None,
        "idempotency_key_reused",
    )


class Pending:
    """A claimed key: record the answer, then store or release it."""

    __slots__ = ("claim", "endpoint_id", "fp", "key", "recorder")

    def __init__(self, endpoint_id: str, key: bytes, fp: bytes, claim: Claim) -> None:
        self.endpoint_id = endpoint_id
        self.key = key
        self.fp = fp
        self.claim = claim
        self.recorder = Recorder()


class Idempotency:
    def __init__(self, store: IdempotencyStore, clock: Clock, *, lease_s: float) -> None:
        self._store = store
        self._clock = clock
        self._lease_ms = int(lease_s * 1000)
        self._ttl_ms = int(TTL_S * 1000)

    def _now_ms(self) -> float:
        return self._clock.now().timestamp() * 1000.0

    async def begin(
        self, send: Send, endpoint_id: str, key: bytes, path: str, raw: bytes
    ) -> Pending | None:
        """Claim ``key``; None when the request was answered here (replay or error)."""
        if not key or len(key) > MAX_KEY_LEN:
            await errors.send_error(send, invalid_key())
            return None
        fp = fingerprint(path, raw)
        c = await self._store.claim(endpoint_id, key, fp, self._lease_ms, self._now_ms())
        if c.kind == PROCEED:
            return Pending(endpoint_id, key, fp, c)
        if c.kind == REPLAY and c.response is not None:
            await send_replay(send, c.response)
        elif c.kind == IN_FLIGHT:
            await errors.send_error(send, in_flight(), [(b"retry-after", b"1")])
        else:
            await errors.send_error(send, mismatch())
        return None

    async def end(self, p: Pending, ok: bool) -> None:
        """Store the recorded answer (``ok``: the relay delivered it whole) or release."""
        resp = p.recorder.stored() if ok else None
        if resp is None:
            await self._store.release(p.endpoint_id, p.key, p.fp, p.claim.token, p.claim.shared)
            return
        await self._store.complete(
            p.endpoint_id,
            p.key,
            p.fp,
            resp.pack(),
            self._ttl_ms,
            self._now_ms(),
            p.claim.shared,
        )


async def send_replay(send: Send, resp: StoredResponse) -> None:
    headers = [
        *resp.headers,
        (b"content-length", str(len(resp.body)).encode()),
        REPLAY_HEADER,
    ]
    await send({"type": "http.response.start", "status": resp.status, "headers": headers})
    await send({"type": "http.response.body", "body": resp.body})
