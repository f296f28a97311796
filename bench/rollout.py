"""Rolling update vs recreate under load, on a real stack.

Starts ``heteroflow up --demo none`` (server, embedded gateway and a process-runtime
agent in one process, default intervals) in a throw-away data directory, creates one
service of two replicas on a generated tiny GGUF model (the real llama.cpp engine
through the xllamacpp wheel, one CPU thread each) and keeps a steady load on it through
the gateway: ``--streams`` threads (8), each sending one streamed chat after the other
with the OpenAI SDK as an application uses it (its default retries). Then:

1. a **rolling** update, generation 1 -> 2 (new image tag and engine arguments, batch 1);
2. a **recreate**, generation 2 -> 3;

each measured from its ``PUT .../update`` to ``rolling_update_state`` done (``*_s``),
with the requests started in that window: ``sent``, ``failed`` (what the application
saw fail after the SDK's retries), and the first attempts the gateway answered 502 or
503 (``first_attempt_502`` / ``_503``; the SDK retried those). A 503 means no backend
could take the request (the recreate's gap); the 502s are the llama.cpp engine closing a
keep-alive connection after each streamed answer without saying so (the gateway's pooled
connection fails on its next request; nothing was generated, the SDK retries it): the
same rate with or without an update, shown by ``steady`` (the 20 s before the first
update). Last line: one JSON object. About a minute on 2 cores:
``.venv/bin/python bench/rollout.py [--streams 8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lifecycle import MODEL

from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.testing.up_stack import Api, Up, free_port, wait_for

STEADY_S = 20.0


@dataclass
class Request:
    started: float
    ok: bool = False
    error: str = ""


@dataclass
class Load:
    url: str
    key: str
    streams: int
    requests: list[Request] = field(default_factory=list)
    fivexx: list[tuple[float, int]] = field(default_factory=list)  # (when, status)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)
    threads: list[threading.Thread] = field(default_factory=list)

    def _seen(self, r: Any) -> None:  # the SDK's own httpx response
        if r.status_code >= 500:
            with self.lock:
                self.fivexx.append((time.monotonic(), r.status_code))

    def _run(self) -> None:
        client = openai.OpenAI(
            base_url=self.url + "/v1", api_key=self.key, timeout=60,
            http_client=openai.DefaultHttpxClient(event_hooks={"response": [self._seen]}),
        )
        while not self.stop.is_set():
            req = Request(time.monotonic())
            try:
                stream = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "count to ten"}],
                    max_tokens=12,
                    stream=True,
                )
                req.ok = sum(1 for _ in stream) > 0
                if not req.ok:
                    req.error = "an empty stream"
            except Exception as exc:  # every failure is a finding
                req.error = f"{type(exc).__name__}: {str(exc)[:200]}"
            with self.lock:
                self.requests.append(req)

    def start(self) -> None:
        self.threads = [threading.Thread(target=self._run, daemon=True)
                        for _ in range(self.streams)]
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)

    def window(self, start: float, end: float) -> dict[str, Any]:
        with self.lock:
            reqs = [r for r in self.requests if start <= r.started < end]
            codes = [c for at, c in self.fivexx if start <= at < end]
        failed = [r for r in reqs if not r.ok]
        out: dict[str, Any] = {
            "sent": len(reqs),
            "failed": len(failed),
            "first_attempt_502": codes.count(502),
            "first_attempt_503": codes.count(503),
        }
        if failed:
            out["errors"] = sorted({r.error for r in failed})[:5]
        return out


def update(api: Api, gid: str, body: dict[str, Any], timeout_s: float = 300) -> tuple[
    float, dict[str, Any]
]:
    """PUT .../update and wait for it to end; (seconds, the group at the end)."""
    start = time.monotonic()
    r = api.call("PUT", f"/api/v1/task-groups/{gid}/update", json=body)
    r.raise_for_status()
    last = ""

    def ended() -> dict[str, Any] | None:
        nonlocal last
        g = api.group(gid)
        line = f"{g['rolling_update_state']}: {g['rolling_update_message']}"
        if line != last:
            print(f"  [{time.monotonic() - start:5.1f}s] {line}", flush=True)
            last = line
        return g if g["rolling_update_state"] in ("done", "failed") else None

    g = wait_for("the update to end", ended, timeout_s, 0.2)
    return time.monotonic() - start, g


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=8, help="concurrent streams (default 8)")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hf-rollout-"))
    data = tmp / "data"
    models = data / "models"
    models.mkdir(parents=True)
    model_file = write_tiny_gguf(models / "tiny.gguf")
    pool_start = 30000 + (os.getpid() % 200) * 20
    up = Up(data, free_port(), (pool_start, pool_start + 19))
    out: dict[str, Any] = {"streams": a.streams, "replicas": 2, "cpus": os.cpu_count()}
    load: Load | None = None
    try:
        up.start()
        api = Api(up.url)
        wait_for("the local node", lambda: api.call("GET", "/api/v1/nodes").json(), 60)
        r = api.call(
            "POST",
            "/api/v1/task-groups",
            json={
                "name": "bench",
                "model_name": MODEL,
                "parallelism": "split",
                "world_size": 2,
                "task": {
                    "image": "ghcr.io/ggml-org/llama.cpp:server",
                    "gpu_required": 0,
                    "model_path": str(model_file),
                    "memory_mb": 512,
                    "engine_args": ["-np", "2", "-c", "1024"],
                },
            },
        )
        r.raise_for_status()
        gid, key = r.json()["id"], r.json()["api_key"]
        wait_for("the service running", lambda: api.group(gid)["status"] == "running", 120)
        load = Load(up.url, key, a.streams)
        load.start()
        wait_for("the load to flow", lambda: sum(x.ok for x in load.requests) >= 16, 60)
        steady_from = time.monotonic()
        time.sleep(STEADY_S)
        out["steady"] = {"window_s": STEADY_S, **load.window(steady_from, time.monotonic())}
        print(f"steady: {out['steady']}", flush=True)

        print("rolling update, generation 1 -> 2 (batch 1):", flush=True)
        t0 = time.monotonic()
        took, g = update(api, gid, {
            "strategy": "rolling", "batch_size": 1,
            "image": "ghcr.io/ggml-org/llama.cpp:server-b2",
            "engine_args": ["-np", "2", "-c", "512"],
        })
        out["rolling"] = {
            "state": g["rolling_update_state"], "update_s": round(took, 2),
            **load.window(t0, time.monotonic()),
        }
        print(f"rolling: {out['rolling']}", flush=True)
        time.sleep(3)

        print("recreate, generation 2 -> 3:", flush=True)
        t0 = time.monotonic()
        took, g = update(api, gid, {
            "strategy": "recreate", "image": "ghcr.io/ggml-org/llama.cpp:server-b3",
        })
        time.sleep(2)  # requests held or retried over the gap end after it
        out["recreate"] = {
            "state": g["rolling_update_state"], "update_s": round(took, 2),
            **load.window(t0, time.monotonic() - 2),
        }
        print(f"recreate: {out['recreate']}", flush=True)
    finally:
        if load is not None:
            load.finish()
        up.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
