"""M9 idempotency keys: the record table, the recorder and the claim/end glue."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.policy.idempotency import (
    IN_FLIGHT,
    MISMATCH,
    PROCEED,
    REPLAY,
    Idempotency,
    MemoryTable,
    Recorder,
    StoredResponse,
    fingerprint,
)
from heteroflow.gateway.routing.store import MemoryStore
from heteroflow.gateway.wire.errors import Message

FP = fingerprint("/v1/chat/completions", b'{"a":1}')
FP2 = fingerprint("/v1/chat/completions", b'{"a":2}')


def _resp(body: bytes = b'{"id":"x"}', status: int = 200) -> StoredResponse:
    return StoredResponse(status, ((b"content-type", b"application/json"),), body)


@pytest.mark.feature("M9")
def test_the_fingerprint_covers_the_path_and_the_exact_bytes() -> None:
    assert FP != FP2
    assert fingerprint("/v1/completions", b'{"a":1}') != FP
    assert len(FP) == 64


@pytest.mark.feature("M9")
def test_claim_then_409_then_replay_then_422_for_another_body() -> None:
    t = MemoryTable()
    first = t.claim("ep", b"k", FP, 1000, 0.0)
    assert first.kind == PROCEED and first.token
    assert t.claim("ep", b"k", FP, 1000, 1.0).kind == IN_FLIGHT
    assert t.claim("ep", b"k", FP2, 1000, 1.0).kind == MISMATCH
    t.complete("ep", b"k", FP, _resp().pack(), 86_400_000, 2.0)
    replay = t.claim("ep", b"k", FP, 1000, 3.0)
    assert replay.kind == REPLAY and replay.response == _resp()
    assert t.claim("ep", b"k", FP2, 1000, 3.0).kind == MISMATCH
    # scoped to the endpoint: another key's endpoint may use the same key
    assert t.claim("ep-2", b"k", FP2, 1000, 3.0).kind == PROCEED


@pytest.mark.feature("M9")
def test_records_expire_after_their_lease_or_ttl() -> None:
    t = MemoryTable()
    t.claim("ep", b"k", FP, 1000, 0.0)
    assert t.claim("ep", b"k", FP, 1000, 999.0).kind == IN_FLIGHT
    again = t.claim("ep", b"k", FP, 1000, 1000.0)  # the lease ran out (a crashed request)
    assert again.kind == PROCEED
    t.complete("ep", b"k", FP, _resp().pack(), 5000, 1000.0)
    assert t.claim("ep", b"k", FP, 1000, 5999.0).kind == REPLAY
    assert t.claim("ep", b"k", FP2, 1000, 6000.0).kind == PROCEED


@pytest.mark.feature("M9")
def test_release_frees_only_our_own_in_flight_record() -> None:
    t = MemoryTable()
    mine = t.claim("ep", b"k", FP, 1000, 0.0)
    t.release(
        "ep",
        b"k",
        FP,
        b"someone-else",
    )
    assert t.claim("ep", b"k", FP, 1000, 1.0).kind == IN_FLIGHT
    t.release("ep", b"k", FP, mine.token)
    assert t.claim("ep", b"k", FP, 1000, 1.0).kind == PROCEED


@pytest.mark.feature("M9")
def test_the_table_is_bounded_and_evicts_done_records_before_in_flight_ones() -> None:
    t = MemoryTable(max_entries=3, max_bytes=10_000)
    t.claim("ep", b"busy", FP, 10_000, 0.0)
    for i in range(5):
        key = b"k%d" % i
        t.claim("ep", key, FP, 10_000, 0.0)
        t.complete("ep", key, FP, _resp().pack(), 10_000, 0.0)
    assert len(t) == 3
    assert t.claim("ep", b"busy", FP, 10_000, 1.0).kind == IN_FLIGHT  # kept
    assert t.claim("ep", b"k4", FP, 10_000, 1.0).kind == REPLAY  # newest kept
    assert t.claim("ep", b"k0", FP, 10_000, 1.0).kind == PROCEED  # oldest evicted

    small = MemoryTable(max_entries=100, max_bytes=3000)
    for i in range(10):
        key = b"b%d" % i
        small.claim("ep", key, FP, 10_000, 0.0)
        small.complete("ep", key, FP, _resp(b"x" * 1000).pack(), 10_000, 0.0)
        assert small.stored_bytes <= 3000
    assert len(small) == 2


@pytest.mark.feature("M9")
def test_a_stored_response_round_trips_binary_safe() -> None:
    r = StoredResponse(
        400, ((b"content-type", b"text/event-stream"), (b"x-odd", b"\xe9t\xe9")), b"\x00\xffdata"
    )
    assert StoredResponse.unpack(r.pack()) == r


def _messages(status: int, *chunks: bytes, end: bool = True) -> list[Message]:
    start: Message = {
        "type": "http.response.start",
        "status": status,
        "headers": [(b"content-type", b"text/event-stream"), (b"content-length", b"9")],
    }
    body: list[Message] = [
        {"type": "http.response.body", "body": c, "more_body": True} for c in chunks
    ]
    if end:
        body.append({"type": "http.response.body", "body": b"", "more_body": False})
    return [start, *body]


@pytest.mark.feature("M9")
@pytest.mark.parametrize(
    ("status", "end", "cap", "stored"),
    [
        (200, True, 100, True),
        (400, True, 100, True),  # the backend's deterministic refusal is the answer
        (500, True, 100, False),
        (429, True, 100, False),
        (409, True, 100, False),
        (200, False, 100, False),  # the client left before the end
        (200, True, 5, False),  # larger than the cap
    ],
)
def test_the_recorder_keeps_only_complete_final_answers(
    status: int, end: bool, cap: int, stored: bool
) -> None:
    rec = Recorder(cap)
    for m in _messages(status, b"data: 1\n\n", b"data: 2\n\n", end=end):
        rec.observe(m)
    got = rec.stored()
    assert (got is not None) == stored
    if got is not None:
        assert got.body == b"data: 1\n\ndata: 2\n\n"
        assert got.headers == ((b"content-type", b"text/event-stream"),)  # no length


class _Sink:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, msg: Message) -> None:
        self.messages.append(msg)

    def status(self) -> int:
        return int(self.messages[0]["status"])

    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    def body(self) -> Any:
        return orjson.loads(b"".join(m.get("body", b"") for m in self.messages[1:]))


@pytest.mark.feature("M9")
@pytest.mark.feature("M12")
def test_begin_and_end_answer_replays_conflicts_and_bad_keys() -> None:
    idem = Idempotency(MemoryStore(), FakeClock(), lease_s=60)

    async def scenario() -> None:
        sink = _Sink()
        p = await idem.begin(sink, "ep", b"key-1", "/v1/embeddings", b"{}")
        assert p is not None and not sink.messages
        busy = _Sink()
        assert await idem.begin(busy, "ep", b"key-1", "/v1/embeddings", b"{}") is None
        assert busy.status() == 409 and busy.headers()[b"retry-after"] == b"1"
        assert busy.body()["error"]["code"] == "idempotency_key_in_use"
        for m in _messages(200, b'{"ok":', b"true}"):
            p.recorder.observe(m)
        await idem.end(p, True)
        replay = _Sink()
        assert await idem.begin(replay, "ep", b"key-1", "/v1/embeddings", b"{}") is None
        assert replay.status() == 200 and replay.body() == {"ok": True}
        assert replay.headers()[b"idempotent-replayed"] == b"true"
        assert replay.headers()[b"content-length"] == b"11"
        other = _Sink()
        assert await idem.begin(other, "ep", b"key-1", "/v1/embeddings", b"{ }") is None
        assert other.status() == 422
        assert other.body()["error"]["code"] == "idempotency_key_reused"
        for bad in (b"", b"x" * 256):
            s = _Sink()
            assert await idem.begin(s, "ep", bad, "/v1/embeddings", b"{}") is None
            assert s.status() == 400
        # a failed answer releases the key: the retry runs
        p = await idem.begin(_Sink(), "ep", b"key-2", "/v1/embeddings", b"{}")
        assert p is not None
        await idem.end(p, False)
        assert await idem.begin(_Sink(), "ep", b"key-2", "/v1/embeddings", b"{}") is not None

    asyncio.run(scenario())
