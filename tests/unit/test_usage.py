"""Token usage: finding it in answers by bytes, and the batching collector."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.policy import usage as usage_mod
from heteroflow.gateway.policy.usage import (
    JsonLinesUsageSink,
    Usage,
    UsageCollector,
    UsageTracker,
    usage_from_json,
)
from heteroflow.schemas.usage import UsageRow


def _chat(usage: object, content: str = "hi") -> bytes:
    return orjson.dumps(
        {
            "id": "x",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
            "usage": usage,
        }
    )


@pytest.mark.feature("M7")
@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (_chat({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}), Usage(7, 3)),
        # nested details (OpenAI, vLLM) and Python's spaced json.dumps
        (
            b'{"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, '
            b'"prompt_tokens_details": {"cached_tokens": 4}, "total_tokens": 7}, "id": "y"}',
            Usage(5, 2),
        ),
        # embeddings have no completion tokens
        (b'{"data":[],"usage":{"prompt_tokens":4,"total_tokens":4}}', Usage(4, 0)),
        (_chat(None), None),
        (b'{"choices":[]}', None),
        (_chat({"prompt_tokens": -1, "completion_tokens": 3}), None),
        (_chat({"prompt_tokens": True, "completion_tokens": 3}), None),
        (_chat({"prompt_tokens": "7", "completion_tokens": 3}), None),
        (b'{"usage":{"prompt_tokens":1', None),  # truncated
    ],
)
def test_usage_from_json(body: bytes, expected: Usage | None) -> None:
    assert usage_from_json(body) == expected


@pytest.mark.feature("M7")
def test_usage_text_inside_content_is_not_taken_for_the_usage() -> None:
    # The content's quotes are escaped, so its "usage": cannot match; the real one does.
    body = _chat(
        {"prompt_tokens": 2, "completion_tokens": 1},
        content='{"usage":{"prompt_tokens":999,"completion_tokens":999}}',
    )
    assert usage_from_json(body) == Usage(2, 1)
    assert usage_from_json(_chat(None, content='"usage":{"prompt_tokens":9}')) is None


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(text: str, *, usage_null: bool = True) -> dict[str, object]:
    c: dict[str, object] = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}],
    }
    if usage_null:
        c["usage"] = None  # vLLM and OpenAI repeat it once include_usage is on
    return c


USAGE_EVENT = _event(
    {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15},
    }
)
BODY = _event(_chunk("a")) + _event(_chunk(" b")) + _event(_chunk(" c"))
STREAM = BODY + USAGE_EVENT + b"data: [DONE]\n\n"


def _relay(chunks: Sequence[bytes], *, hide: bool) -> tuple[bytes, Usage | None]:
    t = UsageTracker(hide=hide)
    out = b"".join(t.feed(c) for c in chunks) + t.finish()
    return out, t.usage


@pytest.mark.feature("M7")
def test_stream_usage_event_is_dropped_only_when_hidden() -> None:
    out, usage = _relay([STREAM], hide=True)
    assert usage == Usage(11, 4)
    assert out == BODY + b"data: [DONE]\n\n"
    out, usage = _relay([STREAM], hide=False)
    assert (out, usage) == (STREAM, Usage(11, 4))


@pytest.mark.feature("M7")
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=12))
def test_stream_usage_survives_any_chunking(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(STREAM)]
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(bounds)]
    out, usage = _relay(chunks, hide=True)
    assert usage == Usage(11, 4)
    assert out == BODY + b"data: [DONE]\n\n"


@pytest.mark.feature("M7")
def test_stream_events_are_sent_whole_and_at_once() -> None:
    t = UsageTracker(hide=True)
    first = _event(_chunk("a"))
    assert t.feed(first[:10]) == b""  # half an event waits
    assert t.feed(first[10:] + b"data: {") == first  # the whole event goes at once
    assert t.finish() == b"data: {"  # an unterminated tail is relayed at the end


@pytest.mark.feature("M7")
def test_crlf_streams_and_usage_in_the_last_choice_chunk() -> None:
    # llama.cpp-style: usage rides on the chunk with finish_reason; it is never dropped.
    last = {
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2},
    }
    stream = (
        b"data: " + orjson.dumps(_chunk("a")) + b"\r\n\r\n"
        b"data: " + orjson.dumps(last) + b"\r\n\r\ndata: [DONE]\r\n\r\n"
    )
    out, usage = _relay([stream[:7], stream[7:]], hide=True)
    assert (out, usage) == (stream, Usage(3, 2))


@pytest.mark.feature("M7")
def test_chunks_with_usage_null_are_not_parsed_or_dropped() -> None:
    out, usage = _relay([BODY], hide=True)
    assert (out, usage) == (BODY, None)


class _Sink:
    def __init__(self) -> None:
        self.batches: list[list[UsageRow]] = []
        self.fail = 0  # fail this many writes

    async def write(self, rows: Sequence[UsageRow]) -> None:
        if self.fail:
            self.fail -= 1
            raise OSError("sink down")
        self.batches.append(list(rows))


def _totals(batches: list[list[UsageRow]]) -> dict[tuple[str, str, str], tuple[int, int, int]]:
    out: dict[tuple[str, str, str], tuple[int, int, int]] = {}
    for rows in batches:
        for r in rows:
            key = (r.endpoint_id, r.tenant_id, r.model)
            req, p, c = out.get(key, (0, 0, 0))
            out[key] = (req + r.requests, p + r.prompt_tokens, c + r.completion_tokens)
    return out


@pytest.mark.feature("M7")
@pytest.mark.feature("N4")
async def test_collector_sums_per_endpoint_and_model() -> None:
    clock, sink = FakeClock(), _Sink()
    c = UsageCollector(sink, clock)
    c.record("ep1", "t1", "m", Usage(10, 5))
    clock.advance(2)
    c.record("ep1", "t1", "m", Usage(1, 1))
    c.record("ep1", "t1", "other", None)  # tokens unknown: counted as a request
    c.record("ep2", "t2", "m", Usage(3, 0))
    assert c.pending_requests == 4
    assert await c.flush()
    assert c.pending_requests == 0
    rows = {(r.endpoint_id, r.model): r for r in sink.batches[0]}
    assert rows["ep1", "m"] == UsageRow(
        "ep1", "t1", "m", 2, 11, 6, clock.now() - timedelta(seconds=2)
    )
    assert (rows["ep1", "other"].requests, rows["ep1", "other"].prompt_tokens) == (1, 0)
    assert rows["ep2", "m"].tenant_id == "t2"
    assert await c.flush()  # nothing new: no empty write
    assert len(sink.batches) == 1


@pytest.mark.feature("M7")
async def test_failed_writes_keep_the_sums_and_log_once(caplog: pytest.LogCaptureFixture) -> None:
    clock, sink = FakeClock(), _Sink()
    c = UsageCollector(sink, clock)
    first_at = clock.now()
    c.record("ep1", "t1", "m", Usage(10, 5))
    sink.fail = 2
    with caplog.at_level(logging.WARNING, logger="heteroflow.gateway.policy.usage"):
        assert not await c.flush()
        clock.advance(5)
        c.record("ep1", "t1", "m", Usage(1, 1))
        assert not await c.flush()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert await c.flush()
    (row,) = sink.batches[0]
    assert (row.requests, row.prompt_tokens, row.completion_tokens) == (2, 11, 6)
    assert row.recorded_at == first_at  # the earliest request of the merged sums


@pytest.mark.feature("M7")
async def test_close_retries_then_reports_what_is_lost(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(usage_mod, "_CLOSE_RETRY_S", 0.0)
    sink = _Sink()
    c = UsageCollector(sink, FakeClock())
    c.record("ep1", "t1", "m", Usage(1, 1))
    sink.fail = 2  # two failures, the third attempt works
    await c.close()
    assert _totals(sink.batches) == {("ep1", "t1", "m"): (1, 1, 1)}
    c.record("ep1", "t1", "m", Usage(1, 1))
    sink.fail = 99
    with caplog.at_level(logging.ERROR, logger="heteroflow.gateway.policy.usage"):
        await c.close()
    assert "1 requests could not be written" in caplog.text


@pytest.mark.feature("M7")
async def test_run_flushes_when_max_records_are_counted() -> None:
    sink = _Sink()
    c = UsageCollector(sink, FakeClock(), interval_s=3600.0, max_records=3)
    stop = asyncio.Event()
    runner = asyncio.create_task(c.run(stop))
    for _ in range(3):
        c.record("ep1", "t1", "m", Usage(1, 2))
    async with asyncio.timeout(5):
        while not sink.batches:
            await asyncio.sleep(0.001)
    stop.set()
    await runner
    assert _totals(sink.batches) == {("ep1", "t1", "m"): (3, 3, 6)}


@pytest.mark.feature("M7")
async def test_run_returns_on_stop_and_close_writes_the_rest() -> None:
    sink = _Sink()
    c = UsageCollector(sink, FakeClock(), interval_s=3600.0)
    stop = asyncio.Event()
    runner = asyncio.create_task(c.run(stop))
    c.record("ep1", "t1", "m", Usage(4, 4))
    stop.set()
    await asyncio.wait_for(runner, 5)
    assert sink.batches == []  # the loop leaves the last word to close()
    await c.close()
    assert _totals(sink.batches) == {("ep1", "t1", "m"): (1, 4, 4)}


@pytest.mark.feature("M7")
async def test_json_lines_sink(tmp_path: Path) -> None:
    path = tmp_path / "usage.jsonl"
    c = UsageCollector(JsonLinesUsageSink(path), FakeClock())
    c.record("team-a", "default", "m", Usage(3, 2))
    await c.close()
    c.record("team-a", "default", "m", Usage(1, 1))
    await c.close()
    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [(x["endpoint_id"], x["requests"], x["prompt_tokens"]) for x in lines] == [
        ("team-a", 1, 3),
        ("team-a", 1, 1),
    ]
    assert lines[0]["recorded_at"] == "2026-01-01T00:00:00+00:00"
