"""Service life figures on a real stack: wake overhead, recovery, restart recovery.

Starts ``heteroflow up --demo none`` (server, embedded gateway and a process-runtime
agent in one process, default intervals) in a throw-away data directory, creates one
service on a generated tiny GGUF model (the real llama.cpp engine through the xllamacpp
wheel, one CPU thread) and measures, through the gateway with the service's API key:

- ``engine_cold_start_ms``: the engine's own cold start, measured in the same run as a
  plain launch: the task's own argv (``launch_argv``) started by hand on a free port,
  from spawn to the first byte of a streamed chat answer (its /health polled every
  10 ms first) — what any platform would pay to start this engine;
- ``wake_ms``: the service put to sleep (``POST /api/v1/task-groups/{id}/sleep``, engine
  process gone, the gateway's snapshot caught up), then a streamed chat request: from
  sending it to its first byte — the request wakes the service and is held (F6);
- ``wake_overhead_ms`` = median(wake_ms) - median(engine_cold_start_ms): what sleeping
  costs on top of the engine's start (target ≤ 1,000 ms);
- ``recovery_s``: ``kill -9`` of the engine → the first successful answer (E1);
- ``restart_recovery_s``: ``heteroflow up`` stopped (SIGTERM: it stops its engines) and
  started again on the same data directory → the first successful answer with the same
  key, no user action (issue 13 item 2).

A figure whose mechanism does not work on this tree is ``null`` and the ``notes`` say
why. Last line: one JSON object. Runs in about a minute on 2 cores:
``.venv/bin/python bench/lifecycle.py [--reps 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.testing import up_stack
from heteroflow.testing.up_stack import Api, Up, free_port, wait_for

MODEL = "bench-model"
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 4,
    "temperature": 0,
}
TARGET_WAKE_OVERHEAD_MS = 1000.0


def first_byte_s(url: str, key: str, timeout_s: float = 120.0) -> float:
    return up_stack.first_byte_s(url, key, CHAT, timeout_s)


def answers(url: str, key: str) -> bool:
    try:
        r = httpx.post(
            url + "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": f"Bearer {key}"},
            timeout=10,
        )
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and bool(dict(r.json()).get("choices"))


def engine_pid(port: int) -> int | None:
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "heteroflow.engines.llamacpp_server" in cmd and str(port) in cmd:
            return int(p.info["pid"])
    return None


def gone(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def plain_cold_start_s(argv: list[str], cwd: Path) -> float:
    """The task's own engine command started by hand on a free port: spawn -> first byte
    of a streamed chat answer."""
    port = free_port()
    args = list(argv)
    i = args.index("--port")
    args[i + 1] = str(port)
    url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    proc = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(
            "plain engine /health",
            lambda: httpx.get(url + "/health", timeout=1).status_code == 200,
            120,
            0.01,
        )
        first_byte_s(url, "")
        return time.monotonic() - start
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=3, help="cold starts and wakes (default 3)")
    a = p.parse_args()
    notes: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="hf-lifecycle-"))
    data = tmp / "data"
    models = data / "models"
    models.mkdir(parents=True)
    model_file = write_tiny_gguf(models / "tiny.gguf")
    pool_start = 30000 + (os.getpid() % 200) * 20
    up = Up(data, free_port(), (pool_start, pool_start + 19))
    out: dict[str, Any] = {}
    try:
        out["up_ready_s"] = round(up.start(), 2)
        api = Api(up.url)
        wait_for("the local node", lambda: api.call("GET", "/api/v1/nodes").json(), 60)
        r = api.call(
            "POST",
            "/api/v1/task-groups",
            json={
                "name": "bench",
                "model_name": MODEL,
                "task": {
                    "image": "ghcr.io/ggml-org/llama.cpp:server",
                    "gpu_required": 0,
                    "model_path": str(model_file),
                    "memory_mb": 512,
                    "engine_args": ["-c", "512"],
                },
            },
        )
        r.raise_for_status()
        g = r.json()
        gid, key = g["id"], g["api_key"]
        t0 = time.monotonic()
        def running() -> dict[str, Any] | None:
            x = api.group(gid)
            return x if x["status"] == "running" else None

        group = wait_for("the service running", running, 120)
        out["first_start_s"] = round(time.monotonic() - t0, 2)
        task = group["tasks"][0]
        port = int(task["ports"][0]["host_port"])
        wait_for("the first answer", lambda: answers(up.url, key), 30)
        shown = api.call("GET", f"/api/v1/tasks/{task['id']}").json()
        argv = [str(x) for x in shown["launch_argv"]]

        # -- the engine's own cold start, and wakes ---------------------------------------
        cold = [plain_cold_start_s(argv, tmp) for _ in range(a.reps)]
        wakes: list[float] = []
        for _ in range(a.reps):
            pid = wait_for("the engine process", lambda: engine_pid(port), 30)
            r = api.call("POST", f"/api/v1/task-groups/{gid}/sleep")
            r.raise_for_status()
            wait_for("the service asleep", lambda: api.group(gid)["status"] == "sleeping", 30)
            wait_for("the engine gone", lambda p=pid: gone(p), 30)  # type: ignore[misc]
            time.sleep(1.0)  # the snapshot shows it asleep (0.5 s interval)
            wakes.append(first_byte_s(up.url, key))
        cold_ms = statistics.median(cold) * 1000
        wake_ms = statistics.median(wakes) * 1000
        out["engine_cold_start_ms"] = round(cold_ms, 1)
        out["engine_cold_start_ms_runs"] = [round(x * 1000, 1) for x in cold]
        out["wake_ms"] = round(wake_ms, 1)
        out["wake_ms_runs"] = [round(x * 1000, 1) for x in wakes]
        out["wake_overhead_ms"] = round(wake_ms - cold_ms, 1)
        out["wake_overhead_target_ms"] = TARGET_WAKE_OVERHEAD_MS
        out["wake_overhead_ok"] = wake_ms - cold_ms <= TARGET_WAKE_OVERHEAD_MS
        print(
            f"engine cold start {cold_ms:.0f} ms; wake on request {wake_ms:.0f} ms; "
            f"overhead {wake_ms - cold_ms:.0f} ms (target <= {TARGET_WAKE_OVERHEAD_MS:.0f})",
            flush=True,
        )

        # -- recovery: kill -9 the engine ------------------------------------------------
        wait_for("an answer", lambda: answers(up.url, key), 30)
        pid = wait_for("the engine process", lambda: engine_pid_any(gid, api), 30)
        start = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            wait_for("an answer after kill -9", lambda: answers(up.url, key), 90, 0.1)
            out["recovery_s"] = round(time.monotonic() - start, 2)
            print(f"kill -9 -> first answer {out['recovery_s']} s", flush=True)
        except TimeoutError as exc:
            out["recovery_s"] = None
            notes.append(f"recovery_s: no answer within 90 s after kill -9 ({exc})")

        # -- restart heteroflow up ---------------------------------------------------------
        up.stop()
        start = time.monotonic()
        up.start()
        try:
            wait_for("an answer after the restart", lambda: answers(up.url, key), 90, 0.1)
            out["restart_recovery_s"] = round(time.monotonic() - start, 2)
            print(f"restart up -> first answer {out['restart_recovery_s']} s", flush=True)
        except TimeoutError as exc:
            out["restart_recovery_s"] = None
            notes.append(f"restart_recovery_s: no answer within 90 s of the restart ({exc})")
    finally:
        up.stop()
    out["reps"] = a.reps
    out["cpus"] = os.cpu_count()
    out["notes"] = notes
    print(json.dumps(out))


def engine_pid_any(group_id: str, api: Api) -> int | None:
    """The engine of the group's current task (its port may have changed on a rebuild)."""
    for t in api.group(group_id)["tasks"]:
        for m in t.get("ports") or ():
            pid = engine_pid(int(m["host_port"]))
            if pid is not None:
                return pid
    return None


if __name__ == "__main__":
    main()
