"""The load report's scrape waits for a busy engine (issue 28: under a full batch, vLLM's
API server answered /metrics after the probe's 1 s, and the autoscaler read "no engine
reports its queue figure" exactly when the queue was long)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.gateway.routing.probes import BackendMonitor

METRICS = (
    "vllm:num_requests_running{model_name=\"m\"} 4.0\n"
    "vllm:num_requests_waiting{model_name=\"m\"} 6.0\n"
    "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.5\n"
)


@pytest.mark.feature("I1")
async def test_a_slow_metrics_answer_still_reaches_the_load_report() -> None:
    async def metrics(_: web.Request) -> web.Response:
        await asyncio.sleep(1.5)  # slower than the 1 s health probe allows
        return web.Response(text=METRICS)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    monitor = BackendMonitor(PassiveHealth(5.0), {}, lambda _: 0, load_scrape_interval_s=0.5)
    monitor._load_scrape_urls = frozenset({url})
    try:
        await monitor.load_scrape_once()
        load = monitor.load_of(url)
        assert load is not None and load.waiting == 6.0
    finally:
        await monitor.aclose()
        await server.close()
