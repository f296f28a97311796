"""``up``'s progress lines for the demo: a kept demo's state from the last run is not
news (stop 39's CI: a restart printed the last shutdown's "agent shut down" reason when
the first poll came before the scheduler had started the engine again)."""

from __future__ import annotations

import asyncio

import pytest

from heteroflow.cmd import up


def _run(states: list[tuple[str, str]], stale: tuple[str, str] | None,
         monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> list[str]:
    seq = iter(states)
    monkeypatch.setattr(up, "_demo_state", lambda app, gid: next(seq))

    async def no_wait(_s: float) -> None:
        return None

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    result = asyncio.run(up._wait_done(None, "tg-x", asyncio.Event(), up.Elapsed(), stale))  # type: ignore[arg-type]
    assert result == states[-1]
    return [line.split("] ", 1)[1] for line in capsys.readouterr().out.splitlines()]


LAST_RUN = ("scheduling", "agent shut down; engine stopped: it starts again on this node")


def test_a_kept_demo_does_not_repeat_the_last_runs_reason(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _run([LAST_RUN, LAST_RUN, ("running", "health check passed")], LAST_RUN,
                 monkeypatch, capsys)
    assert lines == ["demo: scheduling", "demo: running — health check passed"]


def test_a_new_reason_in_the_same_status_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _run([LAST_RUN, ("scheduling", "pulling the image"), ("failed", "no space")],
                 LAST_RUN, monkeypatch, capsys)
    assert lines == ["demo: scheduling", "demo: scheduling — pulling the image",
                     "demo: failed — no space"]


def test_without_a_last_run_every_reason_is_printed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _run([LAST_RUN, ("running", "")], None, monkeypatch, capsys)
    assert lines == [f"demo: {LAST_RUN[0]} — {LAST_RUN[1]}", "demo: running"]
