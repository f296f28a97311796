"""The agent's Prometheus metrics (P3), served on an optional port of the node.

Why a port of its own rather than riding on the heartbeat: what is measured here is the
agent's own view (its heartbeat's round trip and failures, its launches, each card's
memory, temperature and utilisation as NVML read them for this beat's inventory); exported
by the server, every server instance would re-export every node's cards (O(nodes x
cards) per scrape, at 2,000 nodes). The heartbeat does carry the cards' figures — one
number each, which the scheduler and the console's card series (sampled every 10 s)
read — but not as Prometheus series. A port per node is what node_exporter and
DCGM's exporter do: Prometheus scrapes each node, and a dead agent shows as ``up == 0``.
It is off unless ``HETEROFLOW_AGENT_METRICS_PORT`` is set, and binds 127.0.0.1 unless
``HETEROFLOW_AGENT_METRICS_HOST`` says otherwise (it has no authentication).

Series (all ``heteroflow_agent_``):
  card_memory_used_bytes / card_memory_total_bytes{node,card,uuid,model}  gauges
  card_temperature_celsius{node,card,uuid,model}   gauge (cards that report one)
  card_utilization_ratio{node,card,uuid,model}     gauge 0..1 (NVML cards)
  engines{engine,state}                             gauge, state starting | running | asleep
  launches_total{outcome}                           counter, started | failed | port_busy
  heartbeat_duration_seconds                        histogram: the heartbeat's round trip
  heartbeat_failures_total                          counter
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import TypeVar

from aiohttp import web

from heteroflow.agent.inventory import GpuCard, NodeInventory
from heteroflow.core.prometheus import CONTENT_TYPE, Exposition, Histogram

log = logging.getLogger(__name__)
T = TypeVar("T")
P = "heteroflow_agent_"
MIB = 1024 * 1024
HEARTBEAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
LAUNCH_OUTCOMES = ("started", "failed", "port_busy")
EngineCounts = Mapping[tuple[str, str], int]  # (engine, state) -> engines


class AgentMetrics:
    def __init__(self, node: str, timer: Callable[[], float] = time.perf_counter) -> None:
        self.node = node
        self._timer = timer
        self.cards: tuple[GpuCard, ...] = ()
        self.launches = dict.fromkeys(LAUNCH_OUTCOMES, 0)
        self.heartbeats = Histogram(HEARTBEAT_BUCKETS)
        self.heartbeat_failures = 0

    def observe_inventory(self, inv: NodeInventory) -> None:
        """Each heartbeat's inventory (its cards' figures, utilisation included: one NVML
        session a beat, ``inventory.NvmlDiscovery``)."""
        self.cards = inv.gpus

    def launched(self, outcome: str) -> None:
        self.launches[outcome] = self.launches.get(outcome, 0) + 1

    async def heartbeat(self, call: Awaitable[T]) -> T:
        """Await the heartbeat ``call``, timing it, or counting its failure."""
        start = self._timer()
        try:
            result = await call
        except Exception:
            self.heartbeat_failures += 1
            raise
        self.heartbeats.observe(self._timer() - start)
        return result

    def render(self, engines: EngineCounts) -> bytes:
        e = Exposition()
        gauges = (
            ("card_memory_used_bytes", "Memory in use on the card."),
            ("card_memory_total_bytes", "The card's memory."),
            ("card_temperature_celsius", "The card's temperature."),
            ("card_utilization_ratio", "Share of the last sample period the card was busy."),
        )
        samples: dict[str, list[tuple[float, dict[str, str]]]] = {g: [] for g, _ in gauges}
        for card in self.cards:
            labels = {
                "node": self.node, "card": str(card.index), "uuid": card.uuid, "model": card.model
            }
            samples["card_memory_used_bytes"].append((card.memory_used_mb * MIB, labels))
            samples["card_memory_total_bytes"].append((card.memory_total_mb * MIB, labels))
            if card.temperature_c is not None:
                samples["card_temperature_celsius"].append((card.temperature_c, labels))
            if card.utilization_pct is not None:
                samples["card_utilization_ratio"].append((card.utilization_pct / 100, labels))
        for name, text in gauges:
            e.family(P + name, "gauge", text)
            for value, labels in samples[name]:
                e.sample(P + name, value, labels)
        e.family(f"{P}engines", "gauge", "Engines this agent runs, by engine and state.")
        for (engine, state), n in sorted(engines.items()):
            e.sample(f"{P}engines", n, {"engine": engine, "state": state})
        e.family(f"{P}launches_total", "counter", "Engine launches, by outcome.")
        for outcome, n in sorted(self.launches.items()):
            e.sample(f"{P}launches_total", n, {"outcome": outcome})
        e.family(
            f"{P}heartbeat_duration_seconds", "histogram", "Heartbeat round trips that succeeded."
        )
        e.histogram(f"{P}heartbeat_duration_seconds", self.heartbeats)
        e.family(f"{P}heartbeat_failures_total", "counter", "Heartbeats that failed.")
        e.sample(f"{P}heartbeat_failures_total", self.heartbeat_failures)
        return e.render()


def engine_counts(running: Iterable[tuple[str, bool]], asleep: Iterable[str]) -> EngineCounts:
    """(engine, state) counts: ``running`` as (engine, reported running), ``asleep``
    engines by name."""
    out: dict[tuple[str, str], int] = {}
    for engine, up in running:
        key = (engine or "custom", "running" if up else "starting")
        out[key] = out.get(key, 0) + 1
    for engine in asleep:
        key = (engine or "custom", "asleep")
        out[key] = out.get(key, 0) + 1
    return out


async def serve_metrics(
    render: Callable[[], bytes],
    host: str,
    port: int,
    stop: asyncio.Event,
    bound: Callable[[int], None] | None = None,
) -> None:
    """``GET /metrics`` on ``host:port`` until ``stop``; ``bound`` gets the port (0 picks
    one). A port that cannot be bound is logged and the agent goes on without it."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(), headers={"Content-Type": CONTENT_TYPE.decode()})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            log.error("agent metrics not served on %s:%d: %s", host, port, exc.strerror or exc)
            return
        actual = int(runner.addresses[0][1])
        log.info("agent metrics on http://%s:%d/metrics", host, actual)
        if bound is not None:
            bound(actual)
        await stop.wait()
    finally:
        await runner.cleanup()
