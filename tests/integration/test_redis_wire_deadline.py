"""The limit store's RESP connection against a Redis that answers late or never: the
reply deadline is the connection's (``redis_wire._Protocol._expire``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from heteroflow.gateway.wire.redis_wire import RedisWire


class _SlowRedis:
    """A RESP server on 127.0.0.1 that answers each PING with +PONG after ``delay_s``
    (None: never), and counts the connections it accepted."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.connections = 0

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await reader.readuntil(b"PING\r\n"):
                if self.delay_s is not None:
                    await asyncio.sleep(self.delay_s)
                    writer.write(b"+PONG\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.mark.feature("M8")
async def test_a_redis_that_does_not_answer_fails_every_waiting_call_in_time() -> None:
    """The reply deadline is the connection's (one timer, not one per call): calls waiting
    behind a late reply fail with it, the connection is dropped (a late reply would
    otherwise answer the wrong call), and the next call connects again."""
    mute = _SlowRedis(None)
    wire = RedisWire(await mute.start(), reply_timeout_s=0.2)
    t0 = time.monotonic()
    first = asyncio.ensure_future(wire.call(b"PING"))
    await asyncio.sleep(0.1)
    second = asyncio.ensure_future(wire.call(b"PING"))  # its own deadline is later
    got = await asyncio.gather(first, second, return_exceptions=True)
    waited = time.monotonic() - t0
    assert all(isinstance(g, TimeoutError) for g in got), got
    assert 0.2 <= waited < 1.0  # at the first call's deadline, both at once
    mute.delay_s = 0.0  # it answers now: a new connection, a right answer
    assert await wire.call(b"PING") == b"PONG"
    assert mute.connections == 2
    wire.close()
    mute.server.close()


@pytest.mark.feature("M8")
async def test_replies_within_the_deadline_never_time_out_however_long_the_traffic() -> None:
    """The timer armed at the first call's deadline finds it answered and moves to the
    oldest call still waiting: 0.05 s replies over 0.6 s of calls, deadline 0.2 s."""
    slow = _SlowRedis(0.05)
    wire = RedisWire(await slow.start(), reply_timeout_s=0.2)
    replies = []
    for _ in range(12):
        replies.append(await wire.call(b"PING"))
    assert replies == [b"PONG"] * 12 and slow.connections == 1
    wire.close()
    slow.server.close()
