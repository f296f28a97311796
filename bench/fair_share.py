"""Fair share under overload (M16): a quiet tenant's TTFT beside a flooding one, one run.

Starts one real llama.cpp replica (the launcher, ``heteroflow.engines.llamacpp_server``:
``--slots`` slots, one thread) and two standalone gateways (``heteroflow gateway
--routes``) on the same routes file — two keys of two tenants, ``victim`` and ``flood``,
routed to that one replica (one pool): ``fair`` with ``HETEROFLOW_GATEWAY_BACKEND_
CONCURRENCY`` = the replica's slots (fair share on), ``fifo`` without (the default: every
request goes to the engine, which serves its queue first come, first served).

The pool's capacity ``C`` (requests/s) is measured first: ``--slots`` requests kept in
flight for ``--calibrate`` requests. The victim then sends Poisson arrivals at
``--victim-load`` x its fair share (``C / 2``), the same trace three times:

* ``alone``: through ``fifo``, nothing else running (the baseline);
* ``fair``: through ``fair``, beside the flood;
* ``fifo``: through ``fifo``, beside the flood.

The flood is ``--flood-x`` (10) times the flooding tenant's share, as concurrency: its
share of the pool is ``slots / 2`` requests in flight, so it keeps ``flood_x x slots / 2``
requests outstanding at all times (closed loop: a new one as soon as one ends). Offered
as a rate it would be unbounded in ``fifo`` (the engine's queue grows for the whole run);
as concurrency, ``fifo``'s queue holds the flood's requests, and each victim request
waits behind them — what a tenant's burst does today. Every request is a streamed chat
completion of a prompt no other request shares (no prompt cache effects) and
``--max-tokens`` tokens. TTFT is send to first content token, at the client.

Sized for a 2-core machine: a few minutes. Prints a table; the last line is one JSON
object with ``victim_p99_ttft_ms_alone``, ``victim_p99_ttft_ms_fair`` and
``victim_p99_ttft_ms_fifo`` (target: fair at most +20 % over alone).
``--engine fake`` replaces llama.cpp with ``SlotEngine`` (the same slots, a fixed service
time): the scheduling alone. ``--linger 0`` runs the fair gateway work-conserving (free
slots lent to any tenant).
``.venv/bin/python bench/fair_share.py [--slots 4 --duration 60 ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from heteroflow.gateway.wire.errors import Receive, Scope, Send
from heteroflow.models.tiny_gguf import write_sized_gguf
from heteroflow.schemas.routing import hash_key
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from heteroflow.testing.up_stack import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefix_routing import Replica, _listening, _pct, _text

VICTIM_KEY = "sk-fair-share-bench-victim"
FLOOD_KEY = "sk-fair-share-bench-flood"
MODEL = "m"
_TOKEN_MS = [0.0]  # --token-ms (the fake engine's decode step)


class SlotEngine:
    """``--engine fake``: an engine with ``slots`` slots, a FIFO queue before them and a
    service time that does not depend on how many slots are busy (a GPU batch with
    headroom): ``prefill_ms`` after a slot is taken, then ``max_tokens`` chunks
    ``token_ms`` apart (the fake OpenAI backend). What the gateway's scheduling does,
    without the CPU contention of llama.cpp and the load generator on 2 shared cores."""

    def __init__(self, slots: int, prefill_ms: float) -> None:
        self.app = FakeOpenAIBackend([MODEL])
        self.slots = slots
        self.prefill_s = prefill_ms / 1000.0
        self._sem: asyncio.Semaphore | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.slots)  # FIFO: waiters in arrival order
        async with self._sem:
            await asyncio.sleep(self.prefill_s)
            await self.app(scope, receive, send)


def _body(rng: random.Random, prompt_chars: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "user", "content": f"{rng.random():.12f} " + _text(rng, prompt_chars)}
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "fake_chunks": max_tokens,  # --engine fake only (llama.cpp ignores them)
        "fake_delay_ms": _TOKEN_MS[0],
    }


async def _one(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any]) -> float | int:
    """TTFT in seconds of one streamed request, or its status when refused."""
    start = time.perf_counter()
    first = 0.0
    headers = {"authorization": f"Bearer {key}"}
    async with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code
        async for line in r.aiter_lines():
            if first or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                first = time.perf_counter() - start
    return first


async def calibrate(gateway: str, slots: int, n: int, prompt_chars: int, max_tokens: int) -> float:
    """The pool's capacity (requests/s): ``slots`` requests in flight until ``n`` ended."""
    rng = random.Random(1)
    url = f"{gateway}/v1/chat/completions"
    left = n
    async with httpx.AsyncClient(timeout=300) as client:

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await _one(client, url, VICTIM_KEY, _body(rng, prompt_chars, max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(slots)))
        return n / (time.perf_counter() - t0)


async def phase(
    gateway: str,
    arrivals: list[float],
    flood: int,
    prompt_chars: int,
    max_tokens: int,
    seed: int,
) -> dict[str, Any]:
    """The victim's trace through ``gateway``, beside ``flood`` requests kept outstanding."""
    url = f"{gateway}/v1/chat/completions"
    vrng, frng = random.Random(seed), random.Random(seed + 1)
    stop = asyncio.Event()
    flood_done = flood_refused = 0
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def flooder() -> None:
            nonlocal flood_done, flood_refused
            while not stop.is_set():
                got = await _one(client, url, FLOOD_KEY, _body(frng, prompt_chars, max_tokens))
                if isinstance(got, int):
                    flood_refused += 1
                    await asyncio.sleep(0.5)
                else:
                    flood_done += 1

        async def victim(at: float, t0: float) -> float | int:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            return await _one(client, url, VICTIM_KEY, _body(vrng, prompt_chars, max_tokens))

        floods = [asyncio.create_task(flooder()) for _ in range(flood)]
        if flood:
            await asyncio.sleep(3.0)  # the flood is established before the victim starts
        t0 = time.perf_counter()
        got = await asyncio.gather(*(victim(at, t0) for at in arrivals))
        wall = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*floods)
    ttft = sorted(g * 1000 for g in got if isinstance(g, float))
    return {
        "victim_requests": len(got),
        "victim_refused": sum(1 for g in got if isinstance(g, int)),
        "victim_p50_ttft_ms": round(_pct(ttft, 50), 1) if ttft else None,
        "victim_p99_ttft_ms": round(_pct(ttft, 99), 1) if ttft else None,
        "flood_done_per_s": round(flood_done / wall, 2),
        "flood_refused": flood_refused,
    }


def _gateway(routes: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "heteroflow.cli", "gateway", "--port", "0", "--routes", str(routes)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **env},
    )
    assert proc.stdout is not None
    return proc, _listening(proc.stdout, "gateway")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--slots", type=int, default=4, help="llama.cpp slots of the replica")
    ap.add_argument("--mb", type=int, default=20, help="model size (prefill cost)")
    ap.add_argument("--prompt-chars", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--victim-load", type=float, default=0.5, help="x the victim's share")
    ap.add_argument("--flood-x", type=float, default=10.0, help="x the flooder's share")
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of victim arrivals")
    ap.add_argument("--calibrate", type=int, default=40, help="requests to measure capacity")
    ap.add_argument("--seed", type=int, default=16)
    ap.add_argument("--engine", choices=("llamacpp", "fake"), default="llamacpp")
    ap.add_argument("--prefill-ms", type=float, default=100.0, help="--engine fake")
    ap.add_argument("--token-ms", type=float, default=20.0, help="--engine fake")
    ap.add_argument(
        "--linger", type=float, default=None, help="the fair gateway's linger_s (default: its own)"
    )
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="fair-share-"))
    model = work / "model.gguf"
    replica: Replica | None = None
    fake: UvicornThread | None = None
    gateways: list[subprocess.Popen[str]] = []
    try:
        if a.engine == "fake":
            _TOKEN_MS[0] = a.token_ms
            fake = UvicornThread()
            engine_url = f"http://127.0.0.1:{fake.serve(SlotEngine(a.slots, a.prefill_ms))}"
        else:
            replica = Replica(write_sized_gguf(model, a.mb), free_port(), a.slots, 2048, 0)
            engine_url = replica.url
        routes = {
            "models": {MODEL: {"algorithm": "least_connections", "backends": [engine_url]}},
            "keys": {
                "victim": {"sha256": hash_key(VICTIM_KEY), "tenant": "victim"},
                "flood": {"sha256": hash_key(FLOOD_KEY), "tenant": "flood"},
            },
        }
        (work / "routes.json").write_text(json.dumps(routes))
        fair_env = {"HETEROFLOW_GATEWAY_BACKEND_CONCURRENCY": str(a.slots)}
        if a.linger is not None:
            fair_env["HETEROFLOW_GATEWAY_FAIR_SHARE_LINGER_S"] = str(a.linger)
        fair_proc, fair = _gateway(work / "routes.json", fair_env)
        fifo_proc, fifo = _gateway(
            work / "routes.json", {"HETEROFLOW_GATEWAY_BACKEND_CONCURRENCY": "0"}
        )
        gateways += [fair_proc, fifo_proc]

        capacity = asyncio.run(calibrate(fifo, a.slots, a.calibrate, a.prompt_chars, a.max_tokens))
        rate = a.victim_load * capacity / 2
        rng = random.Random(a.seed)
        arrivals: list[float] = []
        t = rng.expovariate(rate)
        while t < a.duration:
            arrivals.append(t)
            t += rng.expovariate(rate)
        flood = max(1, round(a.flood_x * a.slots / 2))
        print(
            f"{a.engine}: 1 replica x {a.slots} slots: capacity {capacity:.2f} req/s; victim "
            f"{rate:.2f} req/s ({a.victim_load:g}x its share), {len(arrivals)} requests; "
            f"flood {flood} outstanding ({a.flood_x:g}x its share)",
            flush=True,
        )
        out: dict[str, Any] = {
            "engine": a.engine,
            "slots": a.slots,
            "capacity_req_per_s": round(capacity, 3),
            "victim_req_per_s": round(rate, 3),
            "victim_requests": len(arrivals),
            "flood_outstanding": flood,
        }
        print(
            f"{'phase':<6} {'victim p50':>10} {'victim p99':>10} {'refused':>8} "
            f"{'flood/s':>8} {'flood 429/503':>13}"
        )
        for name, gw, n in (("alone", fifo, 0), ("fair", fair, flood), ("fifo", fifo, flood)):
            res = asyncio.run(phase(gw, arrivals, n, a.prompt_chars, a.max_tokens, a.seed))
            print(
                f"{name:<6} {res['victim_p50_ttft_ms']:>8}ms {res['victim_p99_ttft_ms']:>8}ms "
                f"{res['victim_refused']:>8} {res['flood_done_per_s']:>8} "
                f"{res['flood_refused']:>13}",
                flush=True,
            )
            out[f"victim_p50_ttft_ms_{name}"] = res["victim_p50_ttft_ms"]
            out[f"victim_p99_ttft_ms_{name}"] = res["victim_p99_ttft_ms"]
            out[f"victim_refused_{name}"] = res["victim_refused"]
            if n:
                out[f"flood_req_per_s_{name}"] = res["flood_done_per_s"]
                out[f"flood_refused_{name}"] = res["flood_refused"]
        # the fair gateway's own view: waits and refusals by reason
        for line in httpx.get(f"{fair}/metrics", timeout=10).text.splitlines():
            if line.startswith("heteroflow_gateway_fair_refusals_total"):
                reason = line.split('reason="')[1].split('"')[0]
                out[f"fair_refused_{reason}"] = int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("heteroflow_gateway_fair_wait_seconds_count"):
                out["fair_waits"] = int(float(line.rsplit(" ", 1)[1]))
        alone, fair_p99 = out["victim_p99_ttft_ms_alone"], out["victim_p99_ttft_ms_fair"]
        out["fair_over_alone"] = round(fair_p99 / alone, 3) if alone and fair_p99 else None
        print(json.dumps(out))
    finally:
        for g in gateways:
            g.terminate()
            g.wait(10)
        if replica is not None:
            replica.stop()
        if fake is not None:
            fake.stop()
        for f in work.iterdir():  # (the model, the routes file)
            f.unlink()
        work.rmdir()


if __name__ == "__main__":
    main()
