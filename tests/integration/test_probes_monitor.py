"""BackendMonitor (M5 active probes, M2 engine metrics scraping) against small aiohttp
backends on loopback. Rounds are driven by hand (probe_once / scrape_once): no sleeps;
one test checks that track() starts the loops and aclose() stops them."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from heteroflow.gateway.backend.engine_metrics import EngineLoad
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.gateway.routing.probes import BackendMonitor
from heteroflow.schemas.routing import Backend, RouteTarget, RoutingSnapshot

VLLM_PAGE = (
    "# TYPE vllm:num_requests_running gauge\n"
    'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0\n'
    'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
)


@dataclass
class FakeEngine:
    health_status: int = 200  # 404: no /health (an external OpenAI-compatible server)
    metrics_status: int = 200
    metrics_page: str = VLLM_PAGE
    hits: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(request.path)
        if request.path == "/health":
            return web.Response(status=self.health_status, text="{}")
        if request.path == "/v1/models":
            return web.json_response({"object": "list", "data": []})
        if request.path == "/metrics":
            return web.Response(status=self.metrics_status, text=self.metrics_page)
        return web.Response(status=404)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    runners: list[web.AppRunner] = []
    out: list[FakeEngine] = []
    for _ in range(2):
        engine = FakeEngine()
        app = web.Application()
        app.router.add_route("GET", "/{tail:.*}", engine.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        engine.url = f"http://127.0.0.1:{port}"
        runners.append(runner)
        out.append(engine)
    yield out
    for runner in runners:
        await runner.cleanup()


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _snapshot(*urls: str, algorithm: str = "round_robin") -> RoutingSnapshot:
    backends = tuple(Backend(f"t{i}", u) for i, u in enumerate(urls))
    target = RouteTarget("r", "g", 0, 1, backends, algorithm)
    return RoutingSnapshot(version=1, routes={("tenant", "model"): (target,)})


def _monitor(
    health: PassiveHealth, loads: dict[str, EngineLoad], clock: _Clock | None = None
) -> BackendMonitor:
    # never start()ed: the tests drive the rounds themselves
    return BackendMonitor(
        health,
        loads,
        lambda url: 2,
        probe_interval_s=10.0,
        probe_timeout_s=1.0,
        clock=clock or _Clock(),
    )


@pytest.mark.feature("M5")
async def test_failed_probe_ejects_and_a_passing_one_restores(engines: list[FakeEngine]) -> None:
    a, b = engines
    clock = _Clock()
    health = PassiveHealth(5.0, clock=clock)
    monitor = _monitor(health, {})
    dead = _dead_url()
    try:
        monitor.track(_snapshot(a.url, b.url, dead))
        await monitor.probe_once()
        assert not health.is_ejected(a.url) and not health.is_ejected(b.url)
        assert health.is_ejected(dead)  # connection refused
        a.health_status = 503  # llama.cpp while it loads the model
        await monitor.probe_once()
        assert health.is_ejected(a.url) and not health.is_ejected(b.url)
        # a failed probe holds the backend out past the passive cooldown, until the next
        # probe is due (interval 10 s + timeout 1 s)
        clock.now += 10.5
        assert health.is_ejected(a.url)
        a.health_status = 200
        await monitor.probe_once()
        assert not health.is_ejected(a.url)
        # routing only: the probe never sent anything but GETs to the backend
        assert set(a.hits) == {"/health"}
    finally:
        await monitor.aclose()


@pytest.mark.feature("M5")
async def test_passing_probe_does_not_cut_a_traffic_ejection_short(
    engines: list[FakeEngine],
) -> None:
    a, _ = engines
    clock = _Clock()
    health = PassiveHealth(5.0, clock=clock)
    monitor = _monitor(health, {})
    try:
        monitor.track(_snapshot(a.url))
        health.eject(a.url)  # a completion answered 5xx; /health is fine
        await monitor.probe_once()
        assert health.is_ejected(a.url)
        clock.now += 5.0
        assert not health.is_ejected(a.url)
    finally:
        await monitor.aclose()


@pytest.mark.feature("M5")
async def test_backend_without_health_is_probed_on_v1_models(engines: list[FakeEngine]) -> None:
    a, _ = engines
    a.health_status = 404
    health = PassiveHealth(5.0, clock=_Clock())
    monitor = _monitor(health, {})
    try:
        monitor.track(_snapshot(a.url))
        await monitor.probe_once()
        await monitor.probe_once()
        assert not health.is_ejected(a.url)
        assert a.hits == ["/health", "/v1/models", "/v1/models"]  # remembered
    finally:
        await monitor.aclose()


@pytest.mark.feature("M2")
async def test_scrapes_only_engine_aware_backends_and_records_the_load(
    engines: list[FakeEngine],
) -> None:
    a, b = engines
    loads: dict[str, EngineLoad] = {}
    monitor = _monitor(PassiveHealth(5.0), loads)
    try:
        monitor.track(_snapshot(a.url, b.url))  # round_robin: nothing to scrape
        await monitor.scrape_once()
        assert loads == {} and a.hits == []
        monitor.track(_snapshot(a.url, b.url, algorithm="engine_aware"))
        b.metrics_page = "sglang:num_running_reqs 1\nsglang:num_queue_reqs 0\n"
        await monitor.scrape_once()
        assert loads == {
            a.url: EngineLoad(3.0, 1.0, 0.5, in_flight_at_scrape=2),
            b.url: EngineLoad(1.0, 0.0, None, in_flight_at_scrape=2),
        }
        b.metrics_page = "nothing useful\n"
        await monitor.scrape_once()
        assert set(loads) == {a.url}  # b falls back to least connections
        monitor.track(_snapshot(a.url))  # a left the engine_aware set
        monitor.track(_snapshot(b.url, algorithm="engine_aware"))
        assert a.url not in loads
    finally:
        await monitor.aclose()


@pytest.mark.feature("M2")
async def test_backend_without_a_metrics_page_is_left_alone_for_a_while(
    engines: list[FakeEngine],
) -> None:
    a, _ = engines
    a.metrics_status = 501  # llama.cpp without --metrics
    clock = _Clock()
    loads: dict[str, EngineLoad] = {}
    monitor = _monitor(PassiveHealth(5.0), loads, clock)
    try:
        monitor.track(_snapshot(a.url, algorithm="engine_aware"))
        for _ in range(3):
            await monitor.scrape_once()
        assert a.hits == ["/metrics"] and loads == {}
        clock.now += 31.0
        a.metrics_status = 200
        await monitor.scrape_once()
        assert a.hits == ["/metrics", "/metrics"] and a.url in loads
    finally:
        await monitor.aclose()


@pytest.mark.feature("M5")
@pytest.mark.feature("M2")
async def test_track_starts_the_loops_and_aclose_stops_them(engines: list[FakeEngine]) -> None:
    a, _ = engines
    a.health_status = 500
    health = PassiveHealth(5.0)
    loads: dict[str, EngineLoad] = {}
    monitor = BackendMonitor(
        health, loads, lambda url: 0, probe_interval_s=0.02, scrape_interval_s=0.02
    )
    monitor.track(_snapshot(a.url, algorithm="engine_aware"))
    monitor.start()
    monitor.start()  # once
    deadline = time.monotonic() + 5.0
    while not (health.is_ejected(a.url) and a.url in loads):
        assert time.monotonic() < deadline, "the loops did not run"
        await asyncio.sleep(0.01)
    await monitor.aclose()
    await asyncio.sleep(0.05)  # a request written just before the stop may still land
    seen = len(a.hits)
    await asyncio.sleep(0.2)  # four probe and scrape intervals
    assert len(a.hits) == seen  # stopped
