"""``heteroflow gateway --workers N`` under load (issue 31, P4): CPU per request, requests
per second, how the connections spread over the workers (accept balance of the shared
socket) and how evenly least_connections keeps two backends busy across workers.

For each N of ``--workers-list`` (default 1,2) it starts the standalone gateway (routes
from a file: one key with RPM/TPM limits that never refuse, so limits run through Redis,
least_connections over two fake backends in this process), then drives it closed-loop
with C keep-alive connections (aiohttp) for ``--duration`` seconds, non-stream and then
16-chunk streams. CPU is the gateway's whole process tree (parent and workers, from
/proc), divided by the requests answered. The backends' in-flight counts are sampled
every 5 ms: the largest difference seen and the share of samples within ±1.

Redis: ``$HETEROFLOW_REDIS_URL``, else a ``redis-server`` started here on a free port.
``--gateway-cpus 0-3`` pins the gateway (taskset) for a scaling run on a bigger machine;
the load generator then belongs on other cores (``taskset -c 4-7 python bench/...``).

    .venv/bin/python bench/gateway_workers.py --duration 10 --conns 32

The last line is JSON: ``cpu_ms_per_req_w1``, ``cpu_ms_per_req_w2``, ``cpu_ms_per_stream_w…``,
``rps_w…``, ``errors``, ``worker_share_w2`` (each worker's share of the requests),
``inflight_max_diff_w2`` and ``inflight_within1_pct_w2``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp

from heteroflow.schemas.routing import hash_key
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

KEY = "sk-bench-workers"
WORKER = "x-heteroflow-worker"
_TICKS = os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tree_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` and its children now (seconds)."""
    total = 0.0
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    for p in [str(pid), *kids]:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / _TICKS
    return total


class Sampler(threading.Thread):
    """The two backends' in-flight counts every 5 ms while load runs."""

    def __init__(self, a: FakeOpenAIBackend, b: FakeOpenAIBackend) -> None:
        super().__init__(daemon=True)
        self.a, self.b = a, b
        self.diffs: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.005):
            if self.a.in_flight or self.b.in_flight:
                self.diffs.append(abs(self.a.in_flight - self.b.in_flight))


async def _drive(url: str, conns: int, duration: float, body: dict[str, Any]) -> dict[str, Any]:
    stream = bool(body.get("stream"))
    done = 0
    errors = 0
    workers: collections.Counter[str] = collections.Counter()
    end = time.monotonic() + duration
    headers = {"authorization": f"Bearer {KEY}"}
    connector = aiohttp.TCPConnector(limit=conns, force_close=False)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def client() -> None:
            nonlocal done, errors
            while time.monotonic() < end:
                try:
                    async with session.post(url, json=body, headers=headers) as r:
                        data = await r.read()
                        ok = r.status == 200 and (not stream or data.endswith(b"[DONE]\n\n"))
                        if ok:
                            done += 1
                            workers[r.headers.get(WORKER, "single")] += 1
                        else:
                            errors += 1
                except (aiohttp.ClientError, TimeoutError):
                    errors += 1

        await asyncio.gather(*(client() for _ in range(conns)))
    return {"done": done, "errors": errors, "workers": dict(workers)}


def _start_gateway(
    n: int, routes: Path, port: int, env: dict[str, str], cpus: str | None
) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "heteroflow.cli", "gateway", "--routes", str(routes)]
    argv += ["--port", str(port), "--workers", str(n)]
    if cpus:
        argv = ["taskset", "-c", cpus, *argv]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if re.search(r"listening on", line):
            return proc
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"the gateway with {n} workers did not start")


def _redis(env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    if env.get("HETEROFLOW_REDIS_URL"):
        return None
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("--workers N > 1 needs Redis: set HETEROFLOW_REDIS_URL or install redis")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    env["HETEROFLOW_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    time.sleep(0.5)
    return proc


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers-list", default="1,2")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--conns", type=int, default=32)
    p.add_argument("--delay-ms", type=int, default=5, help="the backends' answer time")
    p.add_argument("--gateway-cpus", default=None, help="taskset -c for the gateway")
    a = p.parse_args()

    thread = UvicornThread()
    fakes = [FakeOpenAIBackend(["engine"], name=n) for n in ("a", "b")]
    urls = [f"http://127.0.0.1:{thread.serve(f)}/v1" for f in fakes]
    env = {**os.environ, "HETEROFLOW_ROUTES_RELOAD_INTERVAL_S": "3600"}
    redis = _redis(env)
    env["HETEROFLOW_REDIS_KEY_PREFIX"] = f"bench-workers-{os.getpid()}:"
    work = Path(tempfile.mkdtemp(prefix="gw-workers-"))
    routes = work / "routes.json"
    limits = {"rpm_limit": 1_000_000_000, "tpm_limit": 1_000_000_000_000}
    routes.write_text(
        json.dumps(
            {
                "models": {"chat": {"algorithm": "least_connections", "backends": urls}},
                "keys": {"bench": {"sha256": hash_key(KEY), "tenant": "bench", **limits}},
            }
        )
    )
    msg = [{"role": "user", "content": "hi"}]
    plain = {"model": "chat", "messages": msg, "fake_chunks": 8, "fake_delay_ms": a.delay_ms}
    streamed = {"model": "chat", "messages": msg, "stream": True, "fake_chunks": 16}
    out: dict[str, Any] = {"conns": a.conns, "duration_s": a.duration, "errors": 0}
    try:
        for n in (int(x) for x in a.workers_list.split(",")):
            port = _free_port()
            gw = _start_gateway(n, routes, port, env, a.gateway_cpus)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            try:
                asyncio.run(_drive(url, a.conns, a.warmup, plain))
                for kind, body in (("req", plain), ("stream", streamed)):
                    sampler = Sampler(*fakes)
                    sampler.start()
                    cpu0, t0 = _tree_cpu_s(gw.pid), time.monotonic()
                    got = asyncio.run(_drive(url, a.conns, a.duration, body))
                    cpu1, t1 = _tree_cpu_s(gw.pid), time.monotonic()
                    sampler.stop.set()
                    sampler.join()
                    done = max(1, got["done"])
                    out["errors"] += got["errors"]
                    out[f"cpu_ms_per_{kind}_w{n}"] = round((cpu1 - cpu0) * 1000 / done, 4)
                    out[f"rps_{kind}_w{n}"] = round(got["done"] / (t1 - t0), 1)
                    shares = sorted(got["workers"].values(), reverse=True)
                    out[f"worker_share_{kind}_w{n}"] = [round(s / done, 3) for s in shares]
                    if kind == "req" and sampler.diffs:
                        d = sampler.diffs
                        out[f"inflight_max_diff_w{n}"] = max(d)
                        within = sum(1 for x in d if x <= 1) * 100 / len(d)
                        out[f"inflight_within1_pct_w{n}"] = round(within, 1)
                    print(
                        f"workers={n} {kind}: {got['done']} ok, {got['errors']} errors, "
                        f"{out[f'rps_{kind}_w{n}']} req/s, "
                        f"{out[f'cpu_ms_per_{kind}_w{n}']} ms CPU each, "
                        f"per worker {got['workers']}",
                        flush=True,
                    )
            finally:
                gw.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    gw.wait(30)
                if gw.poll() is None:
                    gw.kill()
    finally:
        thread.stop()
        if redis is not None:
            redis.terminate()
            redis.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    out["cpu_ms_per_req_w1"] = out.get("cpu_ms_per_req_w1")
    out["cpu_ms_per_req_w2"] = out.get("cpu_ms_per_req_w2")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
