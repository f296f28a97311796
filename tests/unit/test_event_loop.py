"""The gateway's event loop (``HETEROFLOW_GATEWAY_EVENT_LOOP``, serving.run_on_loop) and
what uvicorn is told on uvloop: libuv takes the backlog as the listen queue's length."""

from __future__ import annotations

import asyncio
import os
import sys

import pytest

from heteroflow import serving
from heteroflow.settings import ServerSettings


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_the_default_is_asyncio_and_uvloop_is_asked_for() -> None:
    assert ServerSettings().gateway_event_loop == "asyncio"
    assert serving.run_on_loop(_loop_module()).startswith("asyncio")
    assert serving.run_on_loop(_loop_module(), "asyncio").startswith("asyncio")
    pytest.importorskip("uvloop")
    assert serving.run_on_loop(_loop_module(), "uvloop").startswith("uvloop")


def test_uvloop_asked_for_but_not_installed_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    with pytest.raises(RuntimeError, match="HETEROFLOW_GATEWAY_EVENT_LOOP=uvloop"):
        serving.run_on_loop(_loop_module(), "uvloop")


def test_the_setting_refuses_other_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETEROFLOW_GATEWAY_EVENT_LOOP", "trio")
    with pytest.raises(ValueError, match="gateway_event_loop"):
        ServerSettings()


async def _config(accept_batch: int) -> tuple[int, bool]:
    server = serving.http_server(object(), accept_batch=accept_batch)
    return server.config.backlog, serving.on_uvloop()


@pytest.mark.feature("P4")
def test_on_uvloop_a_workers_accept_batch_is_not_its_listen_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker's accept batch of 1 passed to libuv as the backlog would make the queue
    the workers share one connection long (a burst then meets refused SYNs); instead the
    backlog stays the listen queue's and libuv spreads accepts itself."""
    pytest.importorskip("uvloop")
    monkeypatch.delenv("UV_TCP_SINGLE_ACCEPT", raising=False)
    assert serving.run_on_loop(_config(1), "asyncio") == (1, False)  # asyncio's accept batch
    assert "UV_TCP_SINGLE_ACCEPT" not in os.environ
    assert serving.run_on_loop(_config(1), "uvloop") == (serving.LISTEN_BACKLOG, True)
    assert os.environ["UV_TCP_SINGLE_ACCEPT"] == "1"
    monkeypatch.delenv("UV_TCP_SINGLE_ACCEPT")
    assert serving.run_on_loop(_config(serving.LISTEN_BACKLOG), "uvloop") == (
        serving.LISTEN_BACKLOG, True,
    )
    assert "UV_TCP_SINGLE_ACCEPT" not in os.environ  # one process: libuv accepts freely
