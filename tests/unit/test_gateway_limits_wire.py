"""The limit store's RESP connection: command encoding and reply parsing, byte-split."""

from __future__ import annotations

import pytest

from heteroflow.gateway.wire.redis_wire import RedisWire, ReplyError, encode, parse


@pytest.mark.feature("M8")
def test_commands_are_resp_arrays_of_bulk_strings() -> None:
    assert encode([b"SET", b"k", b"a\r\nb"]) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$4\r\na\r\nb\r\n"


@pytest.mark.feature("M8")
def test_replies_parse_whole_and_report_incomplete_when_split_anywhere() -> None:
    stream = b"+OK\r\n:42\r\n$-1\r\n$5\r\nab\r\nc\r\n*2\r\n:3\r\n$2\r\n\x00\xff\r\n-NOSCRIPT x\r\n"
    expected = [b"OK", 42, None, b"ab\r\nc", [3, b"\x00\xff"]]
    for cut in range(len(stream)):
        buf = bytearray(stream[:cut])
        got, pos = [], 0
        while True:
            r = parse(buf, pos)
            if not isinstance(r, tuple):
                break
            got.append(r[0])
            pos = r[1]
        assert got == expected[: len(got)]  # a prefix, never a wrong value
    buf, pos, got = bytearray(stream), 0, []
    for _ in range(6):
        r = parse(buf, pos)
        assert isinstance(r, tuple)
        got.append(r[0])
        pos = r[1]
    assert got[:5] == expected and isinstance(got[5], ReplyError)
    assert str(got[5]).startswith("NOSCRIPT") and pos == len(stream)


@pytest.mark.feature("M8")
def test_only_redis_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="scheme"):
        RedisWire("http://127.0.0.1:6379")
    RedisWire("rediss://user:p%40ss@cache.internal:6380/2")
