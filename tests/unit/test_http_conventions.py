"""http_conventions: request ids, CORS policy, stream headers, compressed bodies; and the
provably-unwritten resend of ``upstream`` (issue 15, items 6 and 8)."""

from __future__ import annotations

import gzip
import zlib
from typing import Any

import pytest

from heteroflow.gateway.backend import upstream as upstream_mod
from heteroflow.gateway.backend.upstream import Upstream, UpstreamFailure
from heteroflow.gateway.wire import http_conventions as hc
from heteroflow.gateway.wire.errors import OpenAIError
from heteroflow.gateway.wire.http_wire import Disconnected, Unwritten
from heteroflow.schemas.routing import Backend

LIMIT = 1000


def test_request_id_is_the_callers_when_usable_else_new() -> None:
    assert hc.request_id(b"trace-42") == "trace-42"
    assert hc.request_id(b"x" * 128) == "x" * 128
    for bad in (None, b"", b"x" * 129, b"bad\nid", b"caf\xc3\xa9"):
        rid = hc.request_id(bad)
        assert rid.startswith("req_") and len(rid) == 36
    assert hc.new_request_id() != hc.new_request_id()


def test_stream_headers_replace_the_engines_cache_control() -> None:
    got = hc.stream_headers([(b"content-type", b"text/event-stream"), (b"cache-control", b"x")])
    assert got == [
        (b"content-type", b"text/event-stream"),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
    ]


def test_cors_off_adds_nothing_and_refuses_preflights() -> None:
    cors = hc.Cors([])
    assert not cors.enabled
    assert cors.answer_headers(b"https://app.example") == []
    assert cors.preflight_headers(b"https://app.example", None) is None


def test_cors_list_allows_listed_origins_only_and_varies_on_origin() -> None:
    cors = hc.Cors(["https://app.example/", " "])
    allowed = dict(cors.answer_headers(b"https://app.example"))
    assert allowed[b"access-control-allow-origin"] == b"https://app.example"
    assert b"x-request-id" in allowed[b"access-control-expose-headers"]
    assert allowed[b"vary"] == b"Origin"
    assert cors.answer_headers(b"https://evil.example") == [(b"vary", b"Origin")]
    assert cors.preflight_headers(b"https://evil.example", None) is None
    asked = b"authorization, x-stainless-os"
    pre = dict(cors.preflight_headers(b"https://app.example", asked) or [])
    assert pre[b"access-control-allow-headers"] == asked
    assert pre[b"access-control-allow-methods"] == hc.ALLOWED_METHODS
    # a malformed list of requested headers: the SDKs' own list instead
    pre = dict(cors.preflight_headers(b"https://app.example", b"a b, (c)") or [])
    assert pre[b"access-control-allow-headers"] == hc.DEFAULT_ALLOWED_HEADERS


def test_cors_any_origin_answers_star_without_vary() -> None:
    cors = hc.Cors(["*"])
    assert dict(cors.answer_headers(b"https://x.example"))[b"access-control-allow-origin"] == b"*"
    assert b"vary" not in dict(cors.answer_headers(b"https://x.example"))
    assert cors.answer_headers(None) == []  # no Origin: not a browser's cross-origin call


def test_begin_keeps_the_request_id_in_the_scope() -> None:
    scope: dict[str, Any] = {"headers": [(b"x-request-id", b"abc"), (b"origin", b"https://a")]}
    headers = hc.Conventions(["https://a"]).begin(scope)
    assert scope[hc.REQUEST_ID_KEY] == "abc"
    assert (b"x-request-id", b"abc") in headers
    assert (b"access-control-allow-origin", b"https://a") in headers


BODY = b'{"model": "m", "messages": []}'


# mtime=0: a gzip header holds the time it was made, and the test's id holds the bytes; two
# workers (pytest-xdist) collecting a second apart would name different tests
@pytest.mark.parametrize(
    ("encoding", "data"),
    [
        (b"gzip", gzip.compress(BODY, mtime=0)),
        (b"x-gzip", gzip.compress(BODY, mtime=0)),
        # two members
        (b"GZIP", gzip.compress(BODY[:10], mtime=0) + gzip.compress(BODY[10:], mtime=0)),
        (b"deflate", zlib.compress(BODY)),  # RFC 9110: zlib format
        (b"deflate", zlib.compress(BODY)[2:-4]),  # raw deflate, as some clients send
        (b"identity", BODY),
        (b"deflate, gzip", gzip.compress(zlib.compress(BODY), mtime=0)),  # applied in that order
    ],
)
def test_compressed_bodies_are_decoded(encoding: bytes, data: bytes) -> None:
    assert hc.decode_body(data, encoding, LIMIT) == BODY


def test_a_zip_bomb_stops_at_the_limit() -> None:
    bomb = gzip.compress(b"0" * (LIMIT * 1000))
    err = hc.decode_body(bomb, b"gzip", LIMIT)
    assert isinstance(err, OpenAIError) and err.status == 413
    exact = gzip.compress(b"0" * LIMIT)
    assert hc.decode_body(exact, b"gzip", LIMIT) == b"0" * LIMIT


def test_unknown_or_corrupt_encodings_are_client_errors() -> None:
    err = hc.decode_body(BODY, b"br", LIMIT)
    assert isinstance(err, OpenAIError) and err.status == 415
    assert "'br'" in err.message and err.code == "unsupported_content_encoding"
    for data in (BODY, gzip.compress(BODY)[:-10], gzip.compress(BODY) + b"junk"):
        err = hc.decode_body(data, b"gzip", LIMIT)
        assert isinstance(err, OpenAIError) and err.status == 400, data


class _Pool:
    """Stands in for the wire pool: the pooled attempt fails with ``fail``, a fresh one
    answers ``answer``."""

    def __init__(self, fail: BaseException | None, answer: object) -> None:
        self.fail = fail
        self.answer = answer
        self.calls: list[tuple[bytes, bool]] = []

    async def request(self, *args: bytes | str, fresh: bool = False) -> object:
        headers = args[3]  # (method, url, body, headers), as Upstream.open passes them
        assert isinstance(headers, bytes)
        self.calls.append((headers, fresh))
        if not fresh and self.fail is not None:
            raise self.fail
        return self.answer


class _Answer:
    content_type = "application/json"


@pytest.mark.parametrize(
    ("error", "resent"),
    [
        (Unwritten("closed before the write"), True),
        (Disconnected("closed after the write"), False),  # may have been read: never resent
    ],
)
async def test_open_resends_once_on_a_fresh_connection_only_when_unwritten(
    error: BaseException, resent: bool
) -> None:
    up = Upstream(models_cache_ttl_s=30, upstream_timeout_s=5, connect_timeout_s=1)
    pool = _Pool(error, _Answer())
    up._state().pool = pool  # type: ignore[assignment]
    got = await up.open("http://b/v1/chat/completions", b"{}", Backend("t", "http://b"), "req_1")
    assert pool.calls[0] == (
        b"Content-Type: application/json\r\n"
        + b"%s: req_1\r\n" % upstream_mod.REQUEST_ID_HEADER.encode(),
        False,
    )
    if resent:
        assert isinstance(got, _Answer) and [fresh for _, fresh in pool.calls] == [False, True]
    else:
        assert isinstance(got, UpstreamFailure) and got.error.status == 502
        assert not got.nothing_sent and len(pool.calls) == 1
