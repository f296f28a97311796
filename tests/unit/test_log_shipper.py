"""The agent's log shipper (C6): incremental, nothing lost, nothing sent twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.agent.client import ServerError
from heteroflow.agent.log_shipper import LogShipper, file_source, split_utf8

pytestmark = pytest.mark.feature("C6")


class FakeSource:
    """Lines written by a task; ``since`` is the index of the next unread line."""

    def __init__(self) -> None:
        self.lines: dict[str, list[str]] = {}
        self.reads: list[tuple[str, str]] = []

    def write(self, task_id: str, *lines: str) -> None:
        self.lines.setdefault(task_id, []).extend(lines)

    def __call__(self, task_id: str, since: str) -> tuple[str, str]:
        self.reads.append((task_id, since))
        lines = self.lines.get(task_id, [])
        start = int(since or 0)
        return "".join(f"{x}\n" for x in lines[start:]), str(len(lines))


class FakeClient:
    def __init__(self) -> None:
        self.got: dict[str, list[str]] = {}
        self.fail_next: list[Exception] = []

    async def post_logs(self, task_id: str, text: str) -> None:
        if self.fail_next:
            raise self.fail_next.pop(0)
        self.got.setdefault(task_id, []).append(text)

    def text(self, task_id: str) -> str:
        return "".join(self.got.get(task_id, []))


async def test_ships_only_new_output_each_round() -> None:
    src, client = FakeSource(), FakeClient()
    shipper = LogShipper(client, src)
    src.write("t1", "a", "b")
    src.write("t2", "x")
    assert await shipper.ship_once(["t1", "t2"]) == 2
    assert await shipper.ship_once(["t1", "t2"]) == 0  # nothing new: nothing posted
    src.write("t1", "c")
    await shipper.ship_once(["t1", "t2"])
    assert client.got == {"t1": ["a\nb\n", "c\n"], "t2": ["x\n"]}
    assert shipper.since("t1") == "3"


async def test_a_failed_post_keeps_the_text_and_does_not_reread_the_source() -> None:
    src, client = FakeSource(), FakeClient()
    shipper = LogShipper(client, src)
    src.write("t1", "a")
    client.fail_next = [ConnectionError("server down")]
    assert await shipper.ship_once(["t1"]) == 0
    assert shipper.pending("t1") == 1
    src.write("t1", "b")
    reads = len(src.reads)
    assert await shipper.ship_once(["t1"]) == 1  # the held piece goes first
    assert len(src.reads) == reads  # the source was not read while text was held
    await shipper.ship_once(["t1"])
    assert client.text("t1") == "a\nb\n"  # nothing lost, nothing twice


async def test_big_output_goes_in_pieces_and_resumes_mid_way() -> None:
    src, client = FakeSource(), FakeClient()
    shipper = LogShipper(client, src, max_bytes=10)
    src.write("t1", "0123456789" * 3)  # 31 bytes with the newline -> 4 pieces
    client.fail_next = []
    original = client.post_logs
    calls = 0

    async def flaky(task_id: str, text: str) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise ServerError(503, "busy")
        await original(task_id, text)

    client.post_logs = flaky  # type: ignore[method-assign]
    assert await shipper.ship_once(["t1"]) == 2
    assert await shipper.ship_once(["t1"]) == 2
    assert client.got["t1"] == ["0123456789", "0123456789", "0123456789", "\n"]


async def test_gone_tasks_are_dropped_on_404_and_forget_clears_state() -> None:
    src, client = FakeSource(), FakeClient()
    shipper = LogShipper(client, src)
    src.write("t1", "a")
    client.fail_next = [ServerError(404, "task not on this node")]
    await shipper.ship_once(["t1"])
    assert shipper.pending("t1") == 0 and client.got == {}
    shipper.forget("t1")
    assert shipper.since("t1") == ""


async def test_a_failing_source_skips_the_task_this_round() -> None:
    client = FakeClient()

    def broken(task_id: str, since: str) -> tuple[str, str]:
        raise OSError("no such container")

    shipper = LogShipper(client, broken)
    assert await shipper.ship_once(["t1"]) == 0
    assert shipper.since("t1") == ""


def test_split_utf8_never_cuts_a_character() -> None:
    text = "aé€😀" * 50
    pieces = split_utf8(text, 7)
    assert "".join(pieces) == text
    assert all(len(p.encode()) <= 7 for p in pieces)
    assert split_utf8("", 5) == []


def test_file_source_reads_from_byte_offsets(tmp_path: Path) -> None:
    log = tmp_path / "t1.log"
    read = file_source(lambda t: tmp_path / f"{t}.log", max_bytes=1024)
    assert read("t1", "") == ("", "")  # no file yet
    log.write_bytes(b"line 1\nline 2\npart")
    text, since = read("t1", "")
    assert text == "line 1\nline 2\n"  # the partial line waits for its end
    with open(log, "ab") as f:
        f.write(b"ial \xc3")  # half of an e-acute
    text, since = read("t1", since)  # no newline in reach: whole characters go
    assert (text, since) == ("partial ", "22")
    with open(log, "ab") as f:
        f.write(b"\xa9\n")
    text, since = read("t1", since)
    assert text == "é\n"
    log.write_bytes(b"new\n")  # replaced (shorter): read again from the start
    assert read("t1", since) == ("new\n", "4")


def test_file_source_starts_at_the_tail_and_keeps_chars_whole(tmp_path: Path) -> None:
    log = tmp_path / "t.log"
    log.write_bytes(b"x" * 100 + b"\n" + "é".encode() * 10)
    read = file_source(lambda t: log, max_bytes=9)
    text, since = read("t", "")
    # the last 9 bytes start inside a character: the 4 whole ones after it are read
    assert text == "é" * 4 and since == "121"
    assert read("t", since) == ("", "121")


async def test_concurrent_rounds_neither_crash_nor_send_twice() -> None:
    """The aux loop and a stopping task ship at the same time (a race seen in CI)."""
    import asyncio

    class SlowClient(FakeClient):
        async def post_logs(self, task_id: str, text: str) -> None:
            await asyncio.sleep(0.01)  # both rounds are in flight here
            await super().post_logs(task_id, text)

    src, client = FakeSource(), SlowClient()
    shipper = LogShipper(client, src, max_bytes=4)
    src.write("t1", "aaa", "bbb", "ccc")  # several pieces in the outbox
    await asyncio.gather(shipper.ship_once(["t1"]), shipper.ship_once(["t1"]))
    assert client.text("t1") == "aaa\nbbb\nccc\n"
