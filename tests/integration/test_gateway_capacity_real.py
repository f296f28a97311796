"""Capacity-normalised load (M15, issue 30 item 2) on two real llama.cpp replicas.

Two replicas of one model, one throttled to about a third of the other's CPU: every
``PERIOD_S`` a pacer process lets it run for ``RUN_S`` and stops it (SIGSTOP/SIGCONT,
the duty cycle a CFS quota ``cpu.max = 10ms/30ms`` enforces, without needing a cgroup
this test may not write). Each replica also gets a route of its own, so their *capacity*
is measured through the same gateway, under the same load on this machine's two cores:
both driven to saturation at once, completion tokens per second from their own
``/metrics``. Then the shared route (``algorithm: capacity``) is driven by clients of
the real OpenAI SDK, and each replica's share of its tokens must be the capacity ratio
within ±15 %. Measuring and routing alternate in rounds, so a change in what else runs
on the machine moves both alike.

``HF_CAPACITY_COMPARE=1`` also drives the same replicas by ``least_connections`` and
``round_robin`` and prints each policy's split and latency (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest

from heteroflow.models.tiny_gguf import write_sized_gguf
from tests.gateway_stack import Engine, Served, serve_gateway, snapshot, start_engine, target

KEY = "sk-capacity-real-key-0001"
MB = 20  # the test model widened: ~10 ms per token on one core (decode dominates)
MAX_TOKENS = 24  # the test model never stops early: every answer is this long
RUN_S, PERIOD_S = 0.010, 0.030  # the slow replica runs a third of the time
# On the shared route: enough that the slow replica always has a request queued behind
# the one it runs. ``capacity`` gives it fewer in flight the slower it measures (about 2
# of 8 at a ratio of 7), and with one in flight it idles for the whole turnaround of
# each answer (client, gateway and engine share a busy 2-core box) — idle time its
# capacity phase, queue always full, never had: two CI runs measured a ratio of 6.5-8
# and a split of 120-127 % of it with 8 clients. 12 keep about 3 queued there.
CLIENTS = 12
# Short phases, many rounds: what else runs on the machine changes by the second (a
# shared 2-core box), and alternating makes both measurements see the same drift.
ROUNDS = 10
MEASURE_S, ROUTE_S, SETTLE_S = 2.0, 2.5, 0.5
# Capacity is measured with each replica's queue as full as the shared route keeps it:
# with fewer clients than that, the gateway's turnaround on a loaded machine left the
# fast replica's slots idle between requests and its capacity read ~15 % low.
MEASURE_CLIENTS = 5

_PACER = """
import os, signal, sys, time
pid, run_s, period_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
while True:
    try:
        os.kill(pid, signal.SIGCONT)
        time.sleep(run_s)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(period_s - run_s)
    except ProcessLookupError:
        break
"""


@dataclass
class Pool:
    fast: Engine
    slow: Engine
    gateway: Served


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    work = tmp_path_factory.mktemp("capacity")
    model = write_sized_gguf(work / "model.gguf", MB)
    extra = ("-lv", "0", "--metrics")
    with (
        # one slot each: answers end one at a time, so a window's token count is off by
        # at most one answer at each end (two slots end in pairs)
        start_engine(model, work / "fast.log", *extra, slots=1) as fast,
        start_engine(model, work / "slow.log", *extra, slots=1) as slow,
    ):
        _pin(fast, slow)
        pacer = subprocess.Popen(
            [sys.executable, "-c", _PACER, str(slow.proc.pid), str(RUN_S), str(PERIOD_S)]
        )
        routes = {
            "fast": target("fast", fast.url),
            "slow": target("slow", slow.url),
            "pool": target("pool", fast.url, slow.url, algorithm="capacity"),
            "pool-lc": target("pool-lc", fast.url, slow.url, algorithm="least_connections"),
            "pool-rr": target("pool-rr", fast.url, slow.url, algorithm="round_robin"),
        }
        try:
            with serve_gateway(snapshot(routes, key=KEY)) as gw:
                yield Pool(fast, slow, gw)
        finally:
            pacer.kill()
            pacer.wait()
            os.kill(slow.proc.pid, signal.SIGCONT)  # so that it can stop


def _pin(fast: Engine, slow: Engine) -> None:
    """Each replica on a core of its own, so that what else runs on the machine (spread
    over both cores by the scheduler) slows both alike and their ratio stays the
    throttle's: unpinned, a busy machine moved the measured ratio between 1.8 and 3.5."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    for engine, cpu in ((fast, cpus[0]), (slow, cpus[1])):
        for tid in os.listdir(f"/proc/{engine.proc.pid}/task"):
            os.sched_setaffinity(int(tid), {cpu})


async def _tokens(client: httpx.AsyncClient, engine: Engine) -> float:
    text = (await client.get(f"{engine.url}/metrics")).text
    m = re.search(r"^llamacpp:tokens_predicted_total\s+(\S+)$", text, re.M)
    assert m is not None, text[:500]
    return float(m.group(1))


async def _drive(
    sdk: openai.AsyncOpenAI, model: str, stop: asyncio.Event, lat: list[float]
) -> None:
    """One client: a request as soon as the last one ended, until ``stop``."""
    while not stop.is_set():
        t = time.monotonic()
        r = await sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Count on."}],
            max_tokens=MAX_TOKENS,
            stream=len(lat) % 2 == 0,  # streams and whole answers alike
        )
        if isinstance(r, openai.AsyncStream):
            async for _ in r:
                pass
        lat.append(time.monotonic() - t)


async def _phase(
    pool: Pool, load: dict[str, int], settle_s: float, window_s: float
) -> tuple[float, float, list[float]]:
    """Drive ``load`` (model -> clients) and count each replica's tokens over
    ``window_s`` once ``settle_s`` has passed (counted under load, not as it drains)."""
    stop = asyncio.Event()
    lat: list[float] = []
    sdk = openai.AsyncOpenAI(
        base_url=f"{pool.gateway.url}/v1", api_key=KEY, max_retries=0, timeout=60.0
    )
    async with httpx.AsyncClient(timeout=10) as metrics:
        tasks = [
            asyncio.create_task(_drive(sdk, model, stop, lat))
            for model, n in load.items()
            for _ in range(n)
        ]
        await asyncio.sleep(settle_s)
        before = [await _tokens(metrics, pool.fast), await _tokens(metrics, pool.slow)]
        first = len(lat)
        await asyncio.sleep(window_s)
        after = [await _tokens(metrics, pool.fast), await _tokens(metrics, pool.slow)]
        measured = lat[first:]
        stop.set()
        for task in tasks:  # leave now: the engines stop what was left (a closed stream)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await sdk.close()
    return after[0] - before[0], after[1] - before[1], measured


async def _rounds(pool: Pool, model: str) -> tuple[float, float, list[float], list[float]]:
    """Capacity (both replicas saturated on their own routes) and ``model``'s split,
    alternating; sums of tokens per replica, and the routed requests' latencies."""
    cap = [0.0, 0.0]
    got = [0.0, 0.0]
    lat: list[float] = []
    for _ in range(ROUNDS):
        f, s, _ = await _phase(
            pool, {"fast": MEASURE_CLIENTS, "slow": MEASURE_CLIENTS}, SETTLE_S, MEASURE_S
        )
        cap[0] += f
        cap[1] += s
        f, s, times = await _phase(pool, {model: CLIENTS}, SETTLE_S, ROUTE_S)
        got[0] += f
        got[1] += s
        print(f"round: capacity {cap}, {model} {got}")
        lat += times
    return cap[0] / cap[1], got[0] / got[1], [cap[0], cap[1], got[0], got[1]], lat


def _report(name: str, capacity: float, split: float, tokens: list[float], lat: list[float]) -> str:
    q = statistics.quantiles(lat, n=10)
    return (
        f"{name}: capacity ratio {capacity:.2f}, traffic ratio {split:.2f} "
        f"({split / capacity:.0%} of capacity; tokens {[round(t) for t in tokens]}); "
        f"latency p50 {q[4] * 1000:.0f} ms, p90 {q[8] * 1000:.0f} ms, n={len(lat)}"
    )


@pytest.mark.feature("M15")
def test_a_mixed_pool_splits_traffic_by_capacity(pool: Pool) -> None:
    # Measured twice at most: on the two-worker CI run the other worker's load once made
    # the throttled replica measure 5.5x slower (not 3x) and the split landed at 130 % of
    # it; a second whole measurement (capacity and routing alike) must then hold.
    misses: list[str] = []
    for _ in range(2):
        capacity, split, tokens, lat = asyncio.run(_rounds(pool, "pool"))
        report = _report("capacity", capacity, split, tokens, lat)
        print(report)
        if 0.85 * capacity <= split <= 1.15 * capacity:
            break
        misses.append(report)
    assert capacity > 1.8, f"the throttle did not slow the replica: {capacity:.2f}"
    # what the split came from: the gateway learned each replica's seconds per token
    # from its answers (forward -> Balancer.observe); without it capacity is
    # least_connections, which meets this closed loop's split too (docs/benchmarks.md)
    view = pool.gateway.app._balancer.capacity_view
    now = time.monotonic()
    fast_spt = view.seconds_per_token(pool.fast.url, now)
    slow_spt = view.seconds_per_token(pool.slow.url, now)
    assert 0 < fast_spt < slow_spt / 1.5, (fast_spt, slow_spt)
    assert 0.85 * capacity <= split <= 1.15 * capacity, " / ".join(misses)
    if os.environ.get("HF_CAPACITY_COMPARE"):
        for name in ("pool-lc", "pool-rr"):
            print(_report(name, *asyncio.run(_rounds(pool, name))))
