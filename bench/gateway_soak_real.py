"""Soak against a real engine: C clients through a real gateway to one llama.cpp replica.

Starts the llama.cpp launcher (``python -m heteroflow.engines.llamacpp_server``) on the
tiny test model (``-np 2``) and a standalone gateway (``heteroflow gateway --routes``) in
front of it, then runs C concurrent clients for D seconds, each alternating a streamed
and a non-streamed chat completion (short ``max_tokens``), some after an idle pause that
lets pooled keep-alive connections age (``--idle-every``). It counts answers by status, a
stream that ended with an error event as failed, and the gateway's WARNING log lines by
their message. The last output line is one JSON object (``failed`` = 0 is the target).

    .venv/bin/python bench/gateway_soak_real.py --duration 120 --concurrency 6

The figures depend on the machine: on a busy 2-core CI box the engine, the gateway and
the clients share the cores, which is what makes a race between a pooled connection and
the engine closing it likelier, not less.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

import httpx

from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.routing import hash_key

KEY = "sk-soak-real"
MODEL = "tiny"
WARNING = re.compile(r"WARNING\s+\S+\s+(.*)$")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_engine(model: Path, log: Path, parallel: int) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    argv = [sys.executable, "-m", "heteroflow.engines.llamacpp_server", "-m", str(model)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--alias", MODEL]
    argv += ["-np", str(parallel), "-t", "1", "-lv", "0", "-c", "16384"]
    with log.open("wb") as sink:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=sink)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"engine exited: {log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("engine not ready within 60 s")


def start_gateway(routes: Path, log: Path) -> tuple[subprocess.Popen[str], str, list[str]]:
    """The standalone gateway; its stderr lines are collected in the returned list."""
    argv = [sys.executable, "-m", "heteroflow.cli", "gateway", "--port", "0"]
    argv += ["--routes", str(routes)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ)
    )
    assert proc.stdout is not None
    lines: list[str] = []
    found = threading.Event()
    url: list[str] = []

    def read(out: IO[str]) -> None:
        with log.open("w") as sink:
            for line in out:
                sink.write(line)
                sink.flush()
                lines.append(line.rstrip("\n"))
                m = re.search(r"listening on (http://\S+)", line)
                if m and not found.is_set():
                    url.append(m.group(1))
                    found.set()

    threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
    if not found.wait(60):
        proc.kill()
        raise SystemExit("gateway did not start")
    return proc, url[0], lines


class Tally:
    def __init__(self) -> None:
        self.status: collections.Counter[str] = collections.Counter()
        self.failed = 0
        self.requests = 0
        self.stream_errors = 0
        self.transport_errors: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []


async def one(client: httpx.AsyncClient, stream: bool, max_tokens: int, tally: Tally) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me a story"}],
        "max_tokens": max_tokens,
        "stream": stream,
    }
    started = time.perf_counter()
    tally.requests += 1
    try:
        if stream:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                data = b"".join([c async for c in r.aiter_bytes()])
            ok = r.status_code == 200 and b"data: [DONE]" in data and b'"error"' not in data
            if r.status_code == 200 and not ok:
                tally.stream_errors += 1
        else:
            r = await client.post("/v1/chat/completions", json=body)
            ok = r.status_code == 200
        tally.status[str(r.status_code)] += 1
    except httpx.HTTPError as exc:
        tally.transport_errors[type(exc).__name__] += 1
        ok = False
    tally.latencies.append(time.perf_counter() - started)
    if not ok:
        tally.failed += 1


async def worker(
    url: str, deadline: float, max_tokens: int, idle_every: int, idle_s: float, tally: Tally
) -> None:
    rng = random.Random()
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        n = 0
        while time.monotonic() < deadline:
            await one(client, n % 2 == 0, max_tokens, tally)
            n += 1
            if idle_every and n % idle_every == 0:
                # let the gateway's pooled engine connections sit idle near their limits
                await asyncio.sleep(rng.uniform(0.5, idle_s))


async def drive(url: str, a: argparse.Namespace) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + a.duration
    await asyncio.gather(
        *(
            worker(url, deadline, a.max_tokens, a.idle_every, a.idle_s, tally)
            for _ in range(a.concurrency)
        )
    )
    return tally


def stop(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--parallel", type=int, default=2, help="the engine's -np")
    p.add_argument("--idle-every", type=int, default=7, help="0: never pause")
    p.add_argument("--idle-s", type=float, default=5.5, help="longest pause")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="soak-real-"))
    model = write_tiny_gguf(work / "tiny.gguf")
    engine, engine_url = start_engine(model, work / "engine.log", a.parallel)
    routes = {
        "models": {MODEL: {"algorithm": "least_connections", "backends": [engine_url]}},
        "keys": {"soak": {"sha256": hash_key(KEY), "rpm_limit": 0}},
    }
    (work / "routes.json").write_text(json.dumps(routes))
    gateway, gateway_url, lines = start_gateway(work / "routes.json", work / "gateway.log")
    try:
        started = time.monotonic()
        tally = asyncio.run(drive(gateway_url, a))
        elapsed = time.monotonic() - started
    finally:
        stop(gateway)
        stop(engine)
    warnings: collections.Counter[str] = collections.Counter()
    for line in lines:
        m = WARNING.search(line)
        if m:
            warnings[re.sub(r"http://\S+", "URL", m.group(1))] += 1
    lat = sorted(tally.latencies) or [0.0]
    result = {
        "duration_s": round(elapsed, 1),
        "concurrency": a.concurrency,
        "requests": tally.requests,
        "failed": tally.failed,
        "status": dict(tally.status),
        "stream_errors": tally.stream_errors,
        "transport_errors": dict(tally.transport_errors),
        "p50_s": round(lat[len(lat) // 2], 3),
        "p99_s": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
        "gateway_warnings": dict(warnings),
        "logs": str(work),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
