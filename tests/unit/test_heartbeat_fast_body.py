"""How the heartbeat's fast path reads a body and hands it on (api/heartbeat_fast.py):
what it read is replayed first, then whatever is left, so the API sees the request
exactly as the client sent it — a body split in parts, too large, or a client gone."""

from __future__ import annotations

from typing import Any

from heteroflow.api.heartbeat_fast import read_body, replayed


def receiver(*messages: dict[str, Any]) -> Any:
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    return receive


def part(body: bytes, more: bool) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


async def test_a_body_in_parts_is_read_whole() -> None:
    body, more = await read_body(receiver(part(b"ab", True), part(b"cd", False)), 100)
    assert (body, more) == (b"abcd", False)


async def test_a_body_past_the_limit_is_replayed_then_the_rest_follows() -> None:
    receive = receiver(part(b"abc", True), part(b"def", True), part(b"gh", False))
    body, more = await read_body(receive, 4)
    assert (body, more) == (b"abcdef", True)
    again = replayed(body, more, receive)
    assert await again() == part(b"abcdef", True)
    assert await again() == part(b"gh", False)


async def test_a_client_gone_mid_body_is_seen_by_the_api_too() -> None:
    receive = receiver(part(b"ab", True))
    body, more = await read_body(receive, 100)
    assert (body, more) == (b"ab", True)  # not the fast path's to answer
    again = replayed(body, more, receive)
    assert await again() == part(b"ab", True)
    assert (await again())["type"] == "http.disconnect"
