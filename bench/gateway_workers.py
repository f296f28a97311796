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
``--gateway-cpus 0-3`` pins the gateway (taskset) for a scaling run on a bigger machine.

    .venv/bin/python bench/gateway_workers.py --duration 10 --conns 32

**The scaling run** (``--generator wrk``): the load and the backends of the default mode
are Python in this one process, which cannot drive more than one or two gateway workers'
worth of requests. With ``wrk`` the load is C (``--wrk-threads`` threads, pinned to
``--load-cpus``) and the backends are ``--backend-procs`` processes of the shared
harness's fake engine (``--harness``, pinned to ``--backend-cpus``), non-stream only (no
in-flight sampling: the backends are not in this process). On a 16-core machine:

    .venv/bin/python bench/gateway_workers.py --generator wrk --workers-list 1,2,4,8 \
        --gateway-cpus 0-7 --backend-cpus 8-11 --backend-procs 4 --load-cpus 12-15 \
        --wrk-threads 4 --conns 256

The last line is JSON: ``cpu_ms_per_req_w1``, ``cpu_ms_per_req_w2``, ``cpu_ms_per_stream_w…``,
``rps_req_w…``, ``scaling_w…`` (requests/s with N workers over requests/s with the first
N of the list, same run), ``errors``, ``worker_share_req_w2`` (each worker's share of the
requests), ``inflight_max_diff_w2`` and ``inflight_within1_pct_w2``.
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

ROOT = Path(__file__).resolve().parents[1]
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


def scaling(out: dict[str, Any], workers: list[int]) -> dict[str, float]:
    """``scaling_w{n}``: requests/s with n workers over requests/s with the first of
    ``workers`` (normally 1), from this run's ``rps_req_w{n}``; absent where unmeasured."""
    base = out.get(f"rps_req_w{workers[0]}") if workers else None
    if not base:
        return {}
    return {
        f"scaling_w{n}": round(out[f"rps_req_w{n}"] / base, 2)
        for n in workers
        if out.get(f"rps_req_w{n}")
    }


def _pinned(argv: list[str], cpus: str | None) -> list[str]:
    return ["taskset", "-c", cpus, *argv] if cpus else argv


Backends = list[tuple[subprocess.Popen[bytes], str]]


def _start_backends(harness: Path, n: int, cpus: str | None) -> Backends:
    """``n`` fake engines of the shared harness, each a process, and their base URLs."""
    engine = harness / "fake_engine.py"
    if not engine.is_file():
        raise SystemExit(f"--generator wrk needs the shared harness's fake engine: {engine}")
    out = []
    for _ in range(n):
        port = _free_port()
        argv = [sys.executable, str(engine), "--port", str(port), "--keepalive-timeout", "300"]
        proc = subprocess.Popen(_pinned(argv, cpus), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        out.append((proc, f"http://127.0.0.1:{port}"))
    deadline = time.monotonic() + 30
    for _, url in out:
        while True:
            try:
                with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), 1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(f"the fake engine at {url} did not start") from None
                time.sleep(0.1)
    return out


def _wrk(
    harness: Path, url: str, conns: int, threads: int, duration: float, cpus: str | None
) -> dict[str, Any]:
    """One wrk run (the harness's post.lua: one chat body, the key), its JSON line."""
    if shutil.which("wrk") is None:
        raise SystemExit("--generator wrk needs wrk (apt-get install wrk)")
    argv = ["wrk", f"-t{threads}", f"-c{conns}", f"-d{max(1, round(duration))}s",
            "--timeout", "30s", "-s", str(harness / "conf" / "post.lua"), url]
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    env = {**os.environ, "WRK_BODY": json.dumps(body), "WRK_KEY": KEY, "WRK_LABEL": "workers"}
    done = subprocess.run(_pinned(argv, cpus), capture_output=True, text=True, env=env,
                          timeout=duration + 60, check=False)
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("{")), None)
    if line is None:
        raise SystemExit(f"wrk printed no result: {done.stderr[-500:]}")
    result: dict[str, Any] = json.loads(line)
    return result


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


def _setup(urls: list[str]) -> tuple[dict[str, str], subprocess.Popen[bytes] | None, Path, Path]:
    """The gateways' environment (a Redis for exact limits), the Redis started for it if
    any, a work dir and its routes file: ``chat`` over ``urls`` by least_connections, one
    key whose limits never refuse (they run, through Redis, without deciding anything)."""
    env = {**os.environ, "HETEROFLOW_ROUTES_RELOAD_INTERVAL_S": "3600"}
    redis = _redis(env)
    env["HETEROFLOW_REDIS_KEY_PREFIX"] = f"bench-workers-{os.getpid()}:"
    work = Path(tempfile.mkdtemp(prefix="gw-workers-"))
    routes = work / "routes.json"
    limits = {"rpm_limit": 1_000_000_000, "tpm_limit": 1_000_000_000_000}
    routes.write_text(json.dumps({
        "models": {"chat": {"algorithm": "least_connections", "backends": urls}},
        "keys": {"bench": {"sha256": hash_key(KEY), "tenant": "bench", **limits}},
    }))
    return env, redis, work, routes


def _teardown(redis: subprocess.Popen[bytes] | None, work: Path) -> None:
    if redis is not None:
        redis.terminate()
        redis.wait(10)
    shutil.rmtree(work, ignore_errors=True)


def _stop_gateway(gw: subprocess.Popen[str]) -> None:
    gw.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        gw.wait(30)
    if gw.poll() is None:
        gw.kill()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers-list", default="1,2")
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--conns", type=int, default=32)
    p.add_argument("--delay-ms", type=int, default=5, help="the backends' answer time")
    p.add_argument("--gateway-cpus", default=None, help="taskset -c for the gateway")
    p.add_argument("--generator", choices=["aiohttp", "wrk"], default="aiohttp",
                   help="wrk: the scaling run (see the module doc)")
    p.add_argument("--wrk-threads", type=int, default=2)
    p.add_argument("--backend-procs", type=int, default=2)
    p.add_argument("--load-cpus", default=None, help="taskset -c for wrk")
    p.add_argument("--backend-cpus", default=None, help="taskset -c for the fake engines")
    p.add_argument("--harness", type=Path, default=ROOT.parent / "shared" / "bench" / "gateway")
    a = p.parse_args()
    if a.generator == "wrk":
        _scaling_run(a)
        return

    thread = UvicornThread()
    fakes = [FakeOpenAIBackend(["engine"], name=n) for n in ("a", "b")]
    urls = [f"http://127.0.0.1:{thread.serve(f)}/v1" for f in fakes]
    env, redis, work, routes = _setup(urls)
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
                _stop_gateway(gw)
    finally:
        thread.stop()
        _teardown(redis, work)
    out["cpu_ms_per_req_w1"] = out.get("cpu_ms_per_req_w1")
    out["cpu_ms_per_req_w2"] = out.get("cpu_ms_per_req_w2")
    out.update(scaling(out, [int(x) for x in a.workers_list.split(",")]))
    print(json.dumps(out), flush=True)


def _scaling_run(a: argparse.Namespace) -> None:
    """``--generator wrk``: requests/s and CPU per request at saturation for each N."""
    workers = [int(x) for x in a.workers_list.split(",")]
    backends = _start_backends(a.harness, a.backend_procs, a.backend_cpus)
    env, redis, work, routes = _setup([f"{u}/v1" for _, u in backends])
    out: dict[str, Any] = {
        "generator": "wrk", "conns": a.conns, "duration_s": a.duration, "errors": 0,
        "backend_procs": a.backend_procs, "cpus": os.cpu_count(),
    }
    try:
        for n in workers:
            port = _free_port()
            gw = _start_gateway(n, routes, port, env, a.gateway_cpus)
            url = f"http://127.0.0.1:{port}/v1/chat/completions"
            try:
                _wrk(a.harness, url, a.conns, a.wrk_threads, a.warmup, a.load_cpus)
                cpu0 = _tree_cpu_s(gw.pid)
                got = _wrk(a.harness, url, a.conns, a.wrk_threads, a.duration, a.load_cpus)
                cpu1 = _tree_cpu_s(gw.pid)
                served = max(1, int(got.get("requests", 0)))
                out["errors"] += int(got.get("errors", 0))
                out[f"rps_req_w{n}"] = round(float(got.get("rps", 0.0)), 1)
                out[f"cpu_ms_per_req_w{n}"] = round((cpu1 - cpu0) * 1000 / served, 4)
                out[f"p99_ms_w{n}"] = got.get("lat_ms", {}).get("p99")
                print(f"workers={n}: {out[f'rps_req_w{n}']} req/s, "
                      f"{out[f'cpu_ms_per_req_w{n}']} ms CPU each, {got.get('errors')} errors",
                      flush=True)
            finally:
                _stop_gateway(gw)
    finally:
        for proc, _ in backends:
            proc.terminate()
            proc.wait(10)
        _teardown(redis, work)
    out.update(scaling(out, workers))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
