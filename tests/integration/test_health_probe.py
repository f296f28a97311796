"""The health probe against a real HTTP server on 127.0.0.1 (ephemeral port)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from heteroflow.agent.health_probe import probe
from heteroflow.core.health import HealthCheckConfig

pytestmark = pytest.mark.feature("D3")

HOST = "127.0.0.1"


@pytest.fixture
async def server_port() -> AsyncIterator[int]:
    """/health answers 200 on the first call and 500 after; /slow answers only at
    teardown; /moved is 302."""
    calls = {"health": 0}
    release = asyncio.Event()

    async def health(_: web.Request) -> web.Response:
        calls["health"] += 1
        return web.Response(status=200 if calls["health"] == 1 else 500, text="x")

    async def slow(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    async def moved(_: web.Request) -> web.Response:
        raise web.HTTPFound("/health")

    async def loading(_: web.Request) -> web.Response:  # llama.cpp's answer while it loads
        body = '{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'
        return web.Response(status=503, text=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/loading", loading)
    app.router.add_get("/health", health)
    app.router.add_get("/slow", slow)
    app.router.add_get("/moved", moved)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, HOST, 0)
    await site.start()
    port = int(runner.addresses[0][1])
    try:
        yield port
    finally:
        release.set()
        await runner.cleanup()


@pytest.fixture
def closed_port() -> int:
    """A port that was free a moment ago and has no listener now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
    return port


async def test_http_200_then_500(server_port: int) -> None:
    cfg = HealthCheckConfig(path="/health", timeout_s=2)
    assert await probe(cfg, HOST, server_port) == (True, "HTTP 200")
    assert await probe(cfg, HOST, server_port) == (False, "HTTP 500")


async def test_http_with_shared_session(server_port: int) -> None:
    cfg = HealthCheckConfig(path="/health", timeout_s=2)
    async with aiohttp.ClientSession() as session:
        assert await probe(cfg, HOST, server_port, session) == (True, "HTTP 200")
        assert await probe(cfg, HOST, server_port, session) == (False, "HTTP 500")
        assert not session.closed


@pytest.mark.feature("D5")
async def test_a_failing_answer_carries_its_error_message(server_port: int) -> None:
    """D5: how llama.cpp says it is still loading reaches the agent's load window."""
    cfg = HealthCheckConfig(path="/loading", timeout_s=2)
    assert await probe(cfg, HOST, server_port) == (False, "HTTP 503: Loading model")


async def test_http_redirect_is_not_a_pass(server_port: int) -> None:
    cfg = HealthCheckConfig(path="/moved", timeout_s=2)
    assert await probe(cfg, HOST, server_port) == (False, "HTTP 302")


async def test_http_timeout(server_port: int) -> None:
    cfg = HealthCheckConfig(path="/slow", timeout_s=0.2)
    ok, detail = await probe(cfg, HOST, server_port)
    assert not ok
    assert detail == "timeout after 0.2s"


async def test_http_closed_port_is_connection_refused(closed_port: int) -> None:
    ok, detail = await probe(HealthCheckConfig(timeout_s=2), HOST, closed_port)
    assert not ok
    assert "connection refused" in detail


async def test_http_unresolvable_host_does_not_raise() -> None:
    ok, detail = await probe(HealthCheckConfig(timeout_s=2), "no-such-host.invalid", 80)
    assert not ok and detail


async def test_tcp_open_and_closed(server_port: int, closed_port: int) -> None:
    cfg = HealthCheckConfig(type="tcp", timeout_s=2)
    assert await probe(cfg, HOST, server_port) == (True, "tcp connect ok")
    ok, detail = await probe(cfg, HOST, closed_port)
    assert not ok
    assert "connection refused" in detail
