"""The gateway's own look at its backends: active health probes (M5) and engine metrics
scraping (M2 ``engine_aware``).

``BackendMonitor`` runs two loops on the gateway's event loop, started by ``start()``
and stopped by ``aclose()``; ``track()`` tells it the backends of a new routing snapshot.
The gateway calls both lazily, from the first request that sees a new snapshot:

* probes: every ``probe_interval_s``, ``GET {base}/health`` on every backend of the
  snapshot (``/v1/models`` for a backend that answers 404 there: an external
  OpenAI-compatible server). A connection error, a timeout or a 5xx (llama.cpp answers
  503 while it loads) ejects the backend in the shared ``PassiveHealth`` until the next
  probe is due; an answer below 500 restores it at once. A passing probe does not cut
  short an ejection that real traffic caused (a 5xx on a completion): ``/health`` can be
  fine while completions fail, so that one runs its cooldown. Routing only: nothing here
  touches a task or a container. A first failed probe is logged at INFO (an engine
  stopped as asked, by a delete or a shutdown, fails one probe until the next snapshot
  drops it); a backend still listed that fails its next probe too is a WARNING, once.
* scrapes: every ``scrape_interval_s`` (<= 250 ms), ``GET {base}/metrics`` on the
  backends of ``engine_aware`` targets only; the parsed ``EngineLoad`` is stored in the
  ``loads`` map the ``Balancer`` reads. A failed scrape removes the entry (the balancer
  then falls back to least connections), and a backend without a metrics page (404/501:
  llama.cpp without ``--metrics``) is left alone for ``_NO_METRICS_RETRY_S``.

* load scrapes (issue 14): every ``load_scrape_interval_s`` (5 s; 0 = off), the same
  ``GET {base}/metrics`` on every other backend, kept apart (``load_of``) for the load
  report the gateway sends with its usage flush: the engines' own queue and KV-cache
  use are what the server's autoscaler scales by for the ``queue`` and ``kv_cache``
  metrics. They never feed the balancer (it keeps its own, fresher scrapes).

Each round runs its requests concurrently and waits for all of them (each has its own
timeout), so a slow backend delays nothing but its own next look.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from heteroflow.core.clock import interruptible_sleep
from heteroflow.gateway.backend.engine_metrics import EngineLoad, parse_engine_metrics
from heteroflow.gateway.routing.balancing import ENGINE_AWARE
from heteroflow.gateway.routing.health import PassiveHealth
from heteroflow.schemas.routing import RoutingSnapshot

logger = logging.getLogger(__name__)

DEFAULT_PROBE_INTERVAL_S = 2.0
DEFAULT_PROBE_TIMEOUT_S = 1.0
DEFAULT_SCRAPE_INTERVAL_S = 0.25
DEFAULT_LOAD_SCRAPE_INTERVAL_S = 5.0  # issue 14: the load report's engine figures
_HEALTH_PATH = "/health"
_FALLBACK_PATH = "/v1/models"
_METRICS_PATH = "/metrics"
_NO_METRICS_RETRY_S = 30.0
#: The least time a load-report scrape waits for a busy engine's /metrics.
LOAD_SCRAPE_TIMEOUT_S = 5.0


class BackendMonitor:
    def __init__(
        self,
        health: PassiveHealth,
        loads: dict[str, EngineLoad],
        in_flight: Callable[[str], int],
        *,
        probe_interval_s: float = DEFAULT_PROBE_INTERVAL_S,
        probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        scrape_interval_s: float = DEFAULT_SCRAPE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        snapshot: Callable[[], RoutingSnapshot] | None = None,
        on_snapshot: Callable[[RoutingSnapshot], None] | None = None,
        follow_interval_s: float = 0.25,
        load_scrape_interval_s: float = 0.0,
    ) -> None:
        self._snapshot = snapshot  # where the routing snapshot is read (the holder)
        self._on_snapshot = on_snapshot
        self._follow_interval = follow_interval_s
        self._version: int | None = None
        self._health = health
        self._loads = loads
        self._in_flight = in_flight
        self._probe_interval = probe_interval_s
        self._probe_timeout = aiohttp.ClientTimeout(total=probe_timeout_s)
        self._scrape_interval = scrape_interval_s
        # a scrape must not outlive its round by much: a stale number is worse than none
        self._scrape_timeout = aiohttp.ClientTimeout(total=max(scrape_interval_s, 0.2))
        self._clock = clock
        # A failed probe keeps the backend out until the next probe has had its say.
        self._eject_s = max(health.cooldown_s, probe_interval_s + probe_timeout_s)
        self._probe_urls: frozenset[str] = frozenset()
        self._scrape_urls: frozenset[str] = frozenset()
        self._fallback: set[str] = set()  # backends probed on /v1/models (no /health)
        self._probe_ejected: set[str] = set()  # ejected by a failed probe, not by traffic
        self._failures: dict[str, int] = {}  # base_url -> probes failed in a row
        self._no_metrics: dict[str, float] = {}  # base_url -> clock() to try again
        # issue 14: slower scrapes of the other backends, for the load report only. Their
        # own timeout: an engine busy enough to need scaling answers /metrics slowly (vLLM's
        # API server shares 2 cores with a full batch), and a scrape cut at the probe's
        # 1 s left the autoscaler "no data" exactly then; a load report is not latency-bound
        self._load_scrape_interval = load_scrape_interval_s
        self._load_timeout = aiohttp.ClientTimeout(
            total=max(probe_timeout_s, load_scrape_interval_s, LOAD_SCRAPE_TIMEOUT_S)
        )
        self._load_scrape_urls: frozenset[str] = frozenset()
        self._report_loads: dict[str, EngineLoad] = {}
        self._report_no_metrics: dict[str, float] = {}
        self._session: aiohttp.ClientSession | None = None
        self._auth: dict[str, str] = {}  # base_url -> its Authorization header
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def track(self, snap: RoutingSnapshot) -> None:
        """Follow ``snap``'s backends from the next round on."""
        probe: set[str] = set()
        scrape: set[str] = set()
        auth: dict[str, str] = {}
        for targets in snap.routes.values():
            for t in targets:
                auth.update((b.base_url, b.auth) for b in t.backends if b.auth)
                urls = [b.base_url for b in t.backends]
                probe.update(urls)
                if t.algorithm == ENGINE_AWARE:
                    scrape.update(urls)
        self._auth = auth  # C14: the engine's key, which its door asks of probes too
        self._probe_urls = frozenset(probe)
        self._scrape_urls = frozenset(scrape)
        for url in [u for u in self._loads if u not in scrape]:
            del self._loads[url]
        self._fallback &= probe
        self._probe_ejected &= probe
        for url in [u for u in self._failures if u not in probe]:
            del self._failures[url]
        for url in [u for u in self._no_metrics if u not in scrape]:
            del self._no_metrics[url]
        # issue 14: the load report's scrapes take the backends the balancer does not
        self._load_scrape_urls = frozenset(probe - scrape)
        for url in [u for u in self._report_loads if u not in self._load_scrape_urls]:
            del self._report_loads[url]
        for url in [u for u in self._report_no_metrics if u not in self._load_scrape_urls]:
            del self._report_no_metrics[url]

    def load_of(self, base_url: str) -> EngineLoad | None:
        """The latest engine figures of a backend (the balancer's scrape, else the load
        report's); None when it has not been scraped (or exports no load gauges)."""
        return self._loads.get(base_url) or self._report_loads.get(base_url)

    def follow(self) -> None:
        """Track the current snapshot when its version moved (and tell ``on_snapshot``)."""
        if self._snapshot is None:
            return
        snap = self._snapshot()
        if snap.version == self._version:
            return
        self._version = snap.version
        self.track(snap)
        if self._on_snapshot is not None:
            self._on_snapshot(snap)

    async def _follow_once(self) -> None:
        self.follow()

    def start(self) -> None:
        """Start the loops on the running event loop, once (no-op after ``aclose``)."""
        if self._tasks or self._stop.is_set():
            return
        self.follow()  # the first rounds already see the current backends
        loops = [(self.probe_once, self._probe_interval), (self.scrape_once, self._scrape_interval)]
        loops.append((self.load_scrape_once, self._load_scrape_interval))  # issue 14
        if self._snapshot is not None:
            loops.append((self._follow_once, self._follow_interval))
        self._tasks = [asyncio.create_task(self._run(f, s)) for f, s in loops if s > 0]

    async def aclose(self) -> None:
        self._stop.set()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _run(self, once: Callable[[], Awaitable[None]], interval: float) -> None:
        while not self._stop.is_set():
            try:
                await once()
            except Exception:  # a bug here must not end routing's view of the fleet
                logger.exception("backend monitor round failed")
            if await interruptible_sleep(self._stop, interval):
                return

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
            )
        return self._session

    # -- probes (M5) ------------------------------------------------------------------

    async def probe_once(self) -> None:
        """Probe every tracked backend once, ejecting or restoring each."""
        urls = sorted(self._probe_urls)
        if urls:
            await asyncio.gather(*(self._probe(u) for u in urls))

    async def _probe(self, base_url: str) -> None:
        if await self._probe_status(base_url):
            self._failures.pop(base_url, None)
            if base_url in self._probe_ejected:
                self._probe_ejected.discard(base_url)
                if self._health.restore(base_url):
                    logger.info("backend %s: restored to routing (probe passed)", base_url)
            return
        self._probe_ejected.add(base_url)
        ejected = self._health.eject(base_url, self._eject_s)
        # One failed probe is also what an engine stopped as asked looks like until the
        # next snapshot drops it (a delete, a Ctrl-C): INFO. A backend still listed and
        # still failing at its next probe is a real problem: WARNING, once.
        failures = self._failures[base_url] = self._failures.get(base_url, 0) + 1
        if failures == 2:
            logger.warning(
                "backend %s: failed its health probe twice in a row; out of routing until "
                "it passes",
                base_url,
            )
        elif ejected and failures == 1:
            logger.info("backend %s: ejected from routing (probe failed)", base_url)

    async def _probe_status(self, base_url: str) -> bool:
        path = _FALLBACK_PATH if base_url in self._fallback else _HEALTH_PATH
        status = await self._get_status(base_url, path)
        if status == 404 and path == _HEALTH_PATH:
            self._fallback.add(base_url)
            status = await self._get_status(base_url, _FALLBACK_PATH)
        return status is not None and status < 500

    def _headers(self, base_url: str) -> dict[str, str] | None:
        auth = self._auth.get(base_url)
        return {"Authorization": auth} if auth else None

    async def _get_status(self, base_url: str, path: str) -> int | None:
        try:
            async with self._http().get(
                base_url + path, timeout=self._probe_timeout, headers=self._headers(base_url)
            ) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None

    # -- engine metrics (M2) ----------------------------------------------------------

    async def scrape_once(self) -> None:
        """Scrape every ``engine_aware`` backend once, updating ``loads``."""
        now = self._clock()
        urls = [u for u in sorted(self._scrape_urls) if self._no_metrics.get(u, 0.0) <= now]
        if urls:
            await asyncio.gather(*(self._scrape(u) for u in urls))

    async def _scrape(self, base_url: str) -> None:
        load: EngineLoad | None = None
        try:
            async with self._http().get(
                base_url + _METRICS_PATH, timeout=self._scrape_timeout,
                headers=self._headers(base_url),
            ) as resp:
                text = await resp.text(errors="replace")
                if resp.status in (404, 501):
                    self._no_metrics[base_url] = self._clock() + _NO_METRICS_RETRY_S
                elif resp.status == 200:
                    parsed = parse_engine_metrics(text)
                    if parsed is not None:
                        load = EngineLoad(
                            parsed.running,
                            parsed.waiting,
                            parsed.kv_use,
                            self._in_flight(base_url),
                        )
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            pass
        if load is not None and base_url in self._scrape_urls:
            self._loads[base_url] = load
        else:
            self._loads.pop(base_url, None)

    # -- engine figures for the load report (issue 14) ----------------------------------

    async def load_scrape_once(self) -> None:
        """Scrape every backend the balancer does not, for the load report."""
        now = self._clock()
        urls = [
            u for u in sorted(self._load_scrape_urls) if self._report_no_metrics.get(u, 0.0) <= now
        ]
        if urls:
            await asyncio.gather(*(self._load_scrape(u) for u in urls))

    async def _load_scrape(self, base_url: str) -> None:
        load: EngineLoad | None = None
        try:
            async with self._http().get(
                base_url + _METRICS_PATH, timeout=self._load_timeout,
                headers=self._headers(base_url),
            ) as resp:
                text = await resp.text(errors="replace")
                if resp.status in (404, 501):
                    self._report_no_metrics[base_url] = self._clock() + _NO_METRICS_RETRY_S
                elif resp.status == 200:
                    load = parse_engine_metrics(text)
        except (aiohttp.ClientError, TimeoutError, OSError, UnicodeDecodeError):
            pass
        if load is not None and base_url in self._load_scrape_urls:
            self._report_loads[base_url] = load
        else:
            self._report_loads.pop(base_url, None)
