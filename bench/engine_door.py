"""What the node's door (C14, ``agent.engine_door``) adds to a request.

A fake OpenAI engine (``testing.fake_openai_backend`` under uvicorn) listens on the
node's private loopback; a door relays to it from 127.0.0.1, in a process of its own so
that its CPU is counted alone. The same client calls both, one after the other in the
same run: sequential keep-alive chat completions (latency), then CONC threads at once
(throughput), then streams of CHUNKS chunks. Figures: milliseconds per request direct and
through the door, the difference, and the door's CPU per request and per stream.
Last line: one JSON object of the figures.

    .venv/bin/python bench/engine_door.py            # N=2000 CONC=8 CHUNKS=16
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil

from heteroflow.core.engine_access import ENGINE_ADDRESS

N = int(os.environ.get("N", "2000"))
CONC = int(os.environ.get("CONC", "8"))
CHUNKS = int(os.environ.get("CHUNKS", "16"))
KEY = "hfe-bench"

_ENGINE = """
import sys, uvicorn
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend
uvicorn.run(FakeOpenAIBackend(), host=sys.argv[1], port=int(sys.argv[2]), log_level="error")
"""
_DOOR = """
import sys, threading
from heteroflow.agent.engine_door import Door, EngineDoors
doors = EngineDoors()
doors.open("bench", Door("127.0.0.1", int(sys.argv[1]), sys.argv[2]))
print("open", flush=True)
threading.Event().wait()
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer")


BODY = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def _sequential(url: str) -> float:
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        for _ in range(50):
            c.post(url + "/v1/chat/completions", json=BODY)
        start = time.perf_counter()
        for _ in range(N):
            c.post(url + "/v1/chat/completions", json=BODY).raise_for_status()
        return (time.perf_counter() - start) / N * 1000


def _concurrent(url: str) -> float:
    def worker(_: int) -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as c:
            for _ in range(N // CONC):
                c.post(url + "/v1/chat/completions", json=BODY).raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(CONC) as pool:
        list(pool.map(worker, range(CONC)))
    return (time.perf_counter() - start) / (N // CONC * CONC) * 1000


def _streams(url: str) -> float:
    body = {**BODY, "stream": True, "fake_chunks": CHUNKS}
    n = N // 4
    with httpx.Client(headers={"Authorization": f"Bearer {KEY}"}) as c:
        start = time.perf_counter()
        for _ in range(n):
            with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                for _ in r.iter_bytes():
                    pass
        return (time.perf_counter() - start) / n * 1000


def main() -> None:
    port = _free_port()
    engine = subprocess.Popen([sys.executable, "-c", _ENGINE, ENGINE_ADDRESS, str(port)])
    door = subprocess.Popen(
        [sys.executable, "-c", _DOOR, str(port), KEY], stdout=subprocess.PIPE, text=True
    )
    try:
        assert door.stdout is not None and door.stdout.readline().strip() == "open"
        direct, through = f"http://{ENGINE_ADDRESS}:{port}", f"http://127.0.0.1:{port}"
        _wait(direct)
        door_proc = psutil.Process(door.pid)
        figures: dict[str, float] = {}
        for name, run in (("seq", _sequential), ("conc", _concurrent), ("stream", _streams)):
            figures[f"direct_ms_{name}"] = run(direct)
            cpu0 = sum(door_proc.cpu_times()[:2])
            figures[f"door_ms_{name}"] = run(through)
            cpu = sum(door_proc.cpu_times()[:2]) - cpu0
            count = N // 4 if name == "stream" else N // CONC * CONC if name == "conc" else N
            figures[f"door_cpu_ms_{name}"] = cpu / count * 1000
            figures[f"added_ms_{name}"] = figures[f"door_ms_{name}"] - figures[f"direct_ms_{name}"]
            print(
                f"{name:>6}: direct {figures[f'direct_ms_{name}']:.3f} ms, door "
                f"{figures[f'door_ms_{name}']:.3f} ms (+{figures[f'added_ms_{name}']:.3f}), door "
                f"CPU {figures[f'door_cpu_ms_{name}']:.3f} ms per "
                f"{'stream' if name == 'stream' else 'request'}"
            )
        figures["ratio_seq"] = figures["door_ms_seq"] / figures["direct_ms_seq"]
        print(json.dumps({k: round(v, 4) for k, v in figures.items()}))
    finally:
        for p in (door, engine):
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()
