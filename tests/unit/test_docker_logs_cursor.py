"""The Docker log cursor: the newest timestamp seen, whatever order the log holds lines in.

Docker copies a container's stdout and stderr on separate goroutines, so its json-file log
can hold a line stamped earlier after one stamped later (seen in CI: the stderr line came
after the stdout one with an older stamp, and the next call shipped the stdout line again).
"""

from __future__ import annotations

from typing import Any

from heteroflow.agent.runtime.docker import DockerRuntime, _parse_ts_ns

_OURS = {"Config": {"Labels": {"heteroflow.managed": "true", "heteroflow.agent": "a1"}}}
TASK = "task-0123456789ab"


class _Api:
    """The two Engine API calls ``logs_since`` makes, answering as the Engine would."""

    def __init__(self, lines: list[tuple[str, str]]) -> None:
        self.lines = lines  # (timestamp, text) in the log file's order

    def inspect_container(self, name: str) -> dict[str, Any]:
        return _OURS

    def logs(self, name: str, *, since: float | None = None, **_: Any) -> bytes:
        floor = -1 if since is None else int(since * 1e9)
        kept = [f"{ts} {text}\n" for ts, text in self.lines if (_parse_ts_ns(ts) or 0) >= floor]
        return "".join(kept).encode()


class _Client:
    def __init__(self, api: _Api) -> None:
        self.api = api


def _runtime(lines: list[tuple[str, str]]) -> tuple[DockerRuntime, _Api]:
    api = _Api(lines)
    return DockerRuntime(_Client(api), node_id="n1", agent_id="a1"), api  # type: ignore[arg-type]


def test_a_line_logged_out_of_stamp_order_is_shipped_once() -> None:
    runtime, api = _runtime(
        [("2026-12-01T04:00:00.000200000Z", "a"), ("2026-12-01T04:00:00.000100000Z", "b")]
    )
    text, since = runtime.logs_since(TASK, None)
    assert sorted(text.splitlines()) == ["a", "b"]
    api.lines.append(("2026-12-01T04:00:01.000000000Z", "c"))
    chunk, since = runtime.logs_since(TASK, since)
    assert chunk == "c\n"
    assert runtime.logs_since(TASK, since) == ("", since)


def test_the_cursor_stays_put_when_nothing_new_is_logged() -> None:
    runtime, _ = _runtime([("2026-12-01T04:00:00.5Z", "only")])
    text, since = runtime.logs_since(TASK, None)
    assert text == "only\n"
    assert runtime.logs_since(TASK, since) == ("", since)
