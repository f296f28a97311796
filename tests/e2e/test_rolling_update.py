"""Rolling update end to end (J1, J2, M11): a real server, agent (process runtime) and
separate gateway, real llama.cpp engines, and the OpenAI SDK sending a steady load of
8 concurrent streams through the gateway.

- A rolling update of two replicas (batch 1) from generation 1 to 2 completes with zero
  failed requests: each old replica drains (the gateway sends it nothing new), and is
  stopped once the gateway reports nothing in flight on it.
- An update whose new generation never gets healthy (a bad engine argument) is tried
  again, rolls back, and the old generation serves throughout — again without a failed
  request.

The server's intervals are shortened (snapshot, scheduler, usage flush: the gateway's
load report); nothing else is special."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.conftest import free_port

from .conftest import ADMIN_PASSWORD, GATEWAY_TOKEN, NODE_TOKEN, Stack, spawn, wait_for

pytestmark = pytest.mark.e2e

STREAMS = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("rollout")
    models = tmp / "models"
    models.mkdir()
    model_file = write_tiny_gguf(models / "tiny.gguf")
    server_port, gateway_port = free_port(), free_port()
    pool = random.randint(22000, 31000)
    server_url = f"http://127.0.0.1:{server_port}"
    st = Stack(tmp, models, model_file, server_url, f"http://127.0.0.1:{gateway_port}")
    (tmp / "node.json").write_text(
        json.dumps({"allowed_volume_prefixes": [str(models)], "model_scan_dirs": [str(models)]})
    )
    fast = {
        "HETEROFLOW_SNAPSHOT_INTERVAL_S": "0.2",
        "HETEROFLOW_GATEWAY_POLL_INTERVAL_S": "0.5",
        "HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "1",
    }
    server_env = {
        **fast,
        "HETEROFLOW_DATA_DIR": str(tmp / "server"),
        "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD,
        "HETEROFLOW_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_GATEWAY_TOKEN": GATEWAY_TOKEN,
        "HETEROFLOW_PORT_POOL_START": str(pool),
        "HETEROFLOW_PORT_POOL_END": str(pool + 60),
        "HETEROFLOW_SCHEDULER_INTERVAL_S": "0.2",
        "HETEROFLOW_ROLLOUT_INTERVAL_S": "0.25",
        "HETEROFLOW_ROLLOUT_READY_TIMEOUT_S": "60",
        "HETEROFLOW_ROLLOUT_DRAIN_TIMEOUT_S": "30",
    }
    agent_env = {
        "HETEROFLOW_AGENT_SERVER_URL": server_url,
        "HETEROFLOW_AGENT_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_AGENT_NODE_NAME": "rollout-node",
        "HETEROFLOW_AGENT_CONFIG_FILE": str(tmp / "node.json"),
        "HETEROFLOW_AGENT_WORK_DIR": str(tmp / "agent"),
        "HETEROFLOW_AGENT_HEARTBEAT_INTERVAL_S": "0.3",
        "HETEROFLOW_AGENT_CPU_THREADS": "1",
        "HETEROFLOW_AGENT_RUNTIME": "process",
        "HETEROFLOW_AGENT_LOG_SHIP_INTERVAL_S": "0.5",
        "HETEROFLOW_AGENT_PORT_RETRY_TOTAL_S": "6",
    }
    try:
        st.procs.append(spawn("server", ["server", "--port", str(server_port)], server_env, tmp))
        wait_for(
            lambda: httpx.get(server_url + "/healthz", timeout=1).status_code == 200,
            30, "server /healthz",
        )
        st.procs.append(spawn("agent", ["agent"], agent_env, tmp))
        wait_for(lambda: "process runtime" in st.procs[-1].log.read_text(), 30, "agent start")
        st.procs.append(
            spawn(
                "gateway",
                ["gateway", "--server", server_url, "--token", GATEWAY_TOKEN,
                 "--port", str(gateway_port)],
                fast,
                tmp,
            )
        )
        wait_for(
            lambda: httpx.get(st.gateway_url + "/v1/models", timeout=1).status_code == 401,
            30, "gateway up",
        )
        r = httpx.post(
            server_url + "/api/v1/auth/login",
            json={"username": "admin", "password": ADMIN_PASSWORD},
        )
        st.token = r.json()["access_token"]
        wait_for(lambda: st.api("GET", "/api/v1/nodes").json(), 30, "node registered")
        yield st
    finally:
        for p in reversed(st.procs):
            p.stop()


@dataclass
class Load:
    """``streams`` threads (``STREAMS``), each sending one streamed chat after the other through the
    OpenAI SDK as an application would use it (its default retries of a 502/503).

    ``failures`` are what the application sees fail. ``upstream_5xx`` counts every 5xx
    answer the SDK received, retried or not: the llama.cpp engine (the xllamacpp
    server) closes a keep-alive connection after every streamed answer without saying
    so, and the gateway's pooled connection then fails on its next request with a 502
    that the SDK retries (the gateway never resends a request that may have been
    written) — a steady ~3 % of first attempts with or without an update. A 503 (no
    backend) would be the update's doing and is counted apart."""

    base_url: str
    key: str
    model: str
    sent: int = 0
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    upstream_5xx: list[tuple[float, int]] = field(default_factory=list)
    streams: int = STREAMS
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def _one(self, client: openai.OpenAI) -> None:
        with self.lock:
            self.sent += 1
        try:
            stream = client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": "count to ten"}],
                max_tokens=12,
                stream=True,
            )
            chunks = sum(1 for _ in stream)
            if not chunks:
                raise RuntimeError("an empty stream")
        except Exception as exc:  # every failure is the finding
            with self.lock:
                self.failures.append(f"{time.strftime('%X')} {type(exc).__name__}: {exc}")
            return
        with self.lock:
            self.ok += 1

    def _seen(self, r: Any) -> None:  # the SDK's own httpx response
        if r.status_code >= 500:
            with self.lock:
                self.upstream_5xx.append((time.monotonic(), r.status_code))

    def _run(self) -> None:
        client = openai.OpenAI(
            base_url=self.base_url + "/v1", api_key=self.key, timeout=60,
            http_client=openai.DefaultHttpxClient(event_hooks={"response": [self._seen]}),
        )
        while not self.stop.is_set():
            self._one(client)

    def summary(self) -> str:
        codes = [c for _, c in self.upstream_5xx]
        return (
            f"requests sent {self.sent}, ok {self.ok}, failed {len(self.failures)}; "
            f"first attempts answered 502 {codes.count(502)}, 503 {codes.count(503)}"
        )

    def start(self) -> Load:
        self.threads = [
            threading.Thread(target=self._run, daemon=True) for _ in range(self.streams)
        ]
        for t in self.threads:
            t.start()
        return self

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def service(stack: Stack, name: str) -> tuple[str, str, str]:
    """Two replicas of the tiny model, running; (group id, key, model)."""
    g = stack.create_service(name, parallelism="split", world_size=2)
    stack.wait_status(g["id"], "running", 90)
    model = f"{name}-model"

    def answers() -> bool:
        try:
            c = openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=g["api_key"],
                              max_retries=0, timeout=30)
            r = c.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        except openai.APIError:
            return False
        return bool(r.choices)

    wait_for(answers, 30, "the service to answer", 0.2)
    return str(g["id"]), str(g["api_key"]), model


def follow(stack: Stack, group_id: str, until: set[str], timeout_s: float) -> dict[str, Any]:
    """Wait for the update to reach a state in ``until``; print every new message."""
    seen: list[str] = []
    start = time.monotonic()

    def done() -> dict[str, Any] | None:
        g = stack.group(group_id)
        message = f"{g['rolling_update_state']}: {g['rolling_update_message']}"
        if not seen or seen[-1] != message:
            seen.append(message)
            print(f"[{time.monotonic() - start:5.1f}s] {message}")
        return g if g["rolling_update_state"] in until else None

    return dict(wait_for(done, timeout_s, f"the update of {group_id} to end", 0.2))


def timeline(stack: Stack, group_id: str) -> list[dict[str, Any]]:
    return list(stack.api("GET", f"/api/v1/task-groups/{group_id}/events").json())


@pytest.mark.feature("J1", "J3", "M11")
def test_a_rolling_update_under_load_fails_no_request(stack: Stack) -> None:
    group_id, key, model = service(stack, "rolly")
    before = {t["id"]: t for t in stack.group(group_id)["tasks"]}
    load = Load(stack.gateway_url, key, model).start()
    try:
        wait_for(lambda: load.ok >= 16, 30, "the load to flow")
        started = time.monotonic()
        r = stack.api(
            "PUT", f"/api/v1/task-groups/{group_id}/update",
            json={
                "strategy": "rolling",
                "image": "ghcr.io/ggml-org/llama.cpp:server-b2",
                "engine_args": ["--embeddings", "-np", "2", "-c", "512"],
                "batch_size": 1,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["current_generation"] == 2
        g = follow(stack, group_id, {"done", "failed"}, 150)
        took = time.monotonic() - started
        assert g["rolling_update_state"] == "done", f"{g}\n{stack.logs()}"
        time.sleep(2)  # the load goes on against the new generation alone
    finally:
        load.finish()
    print(f"rolling update: {took:.1f} s; {load.summary()}")
    assert load.failures == [], "\n".join(load.failures[:20]) + "\n" + stack.logs()
    assert 503 not in {c for _, c in load.upstream_5xx}  # never without a backend
    assert load.ok >= 40
    tasks = g["tasks"]
    assert sorted((t["rank"], t["generation"]) for t in tasks) == [(0, 2), (1, 2)]
    for t in tasks:
        assert t["image"] == "ghcr.io/ggml-org/llama.cpp:server-b2"
        argv = t["launch_argv"]
        assert argv[argv.index("-c") + 1] == "512"  # the new generation's own arguments
        assert t["id"] not in before
    for old_id in before:  # replaced, drained before they stopped
        old = stack.api("GET", f"/api/v1/tasks/{old_id}").json()
        assert old["replaced_by"] and old["draining"] and old["status"] == "stopped", old
    kinds = [e["kind"] for e in timeline(stack, group_id)]
    assert kinds.count("drain") == 2 and kinds[-1] != "rollout.failed"
    assert "rollout.done" in kinds


@pytest.mark.feature("J1")
def test_an_update_that_never_gets_healthy_rolls_back_and_the_old_serves(
    stack: Stack,
) -> None:
    group_id, key, model = service(stack, "rollback")
    before = sorted(t["id"] for t in stack.group(group_id)["tasks"])
    load = Load(stack.gateway_url, key, model).start()
    try:
        wait_for(lambda: load.ok >= 16, 30, "the load to flow")
        r = stack.api(
            "PUT", f"/api/v1/task-groups/{group_id}/update",
            json={"image": "ghcr.io/ggml-org/llama.cpp:server-b3",
                  "engine_args": ["--no-such-flag"]},
        )
        assert r.status_code == 200, r.text
        g = follow(stack, group_id, {"done", "failed"}, 150)
        time.sleep(1)
    finally:
        load.finish()
    print(f"rollback: {load.summary()}")
    assert g["rolling_update_state"] == "failed", g
    message = g["rolling_update_message"]
    assert "failed 4 times" in message and "rolled back: generation 1 serves" in message
    assert sorted(t["id"] for t in g["tasks"]) == before  # never drained, never stopped
    assert all(t["status"] == "running" and not t["draining"] for t in g["tasks"])
    assert load.failures == [], "\n".join(load.failures[:20])
    assert 503 not in {c for _, c in load.upstream_5xx}
    kinds = [e["kind"] for e in timeline(stack, group_id)]
    assert kinds.count("rollout.retry") == 3 and kinds[-1] == "rollout.failed"
    assert "drain" not in kinds


# ---- J4: the server holding the update is killed (two servers on PostgreSQL) -------


@pytest.mark.feature("J4")
def test_a_killed_holder_fails_the_update_within_the_lease_ttl_and_it_can_be_resubmitted(
    tmp_path: Any, pg_empty_url: str
) -> None:
    """Servers A (the leader, started first) and B share one PostgreSQL database; the
    agent and the gateway talk to B. The update is submitted to A, which takes its lease
    and starts it; A is killed with SIGKILL. B's expiry scan marks the update failed with
    the reason within the lease TTL (plus one scan interval), the service serves on
    throughout, and the update resubmitted to B completes."""
    import signal

    ttl_s, scan_s = 6.0, 1.0
    models = tmp_path / "models"
    models.mkdir()
    model_file = write_tiny_gguf(models / "tiny.gguf")
    (tmp_path / "node.json").write_text(
        json.dumps({"allowed_volume_prefixes": [str(models)], "model_scan_dirs": [str(models)]})
    )
    pool = random.randint(22000, 31000)
    common = {
        "HETEROFLOW_DATABASE_URL": pg_empty_url,
        "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD,
        "HETEROFLOW_NODE_TOKEN": NODE_TOKEN,
        "HETEROFLOW_GATEWAY_TOKEN": GATEWAY_TOKEN,
        "HETEROFLOW_PORT_POOL_START": str(pool),
        "HETEROFLOW_PORT_POOL_END": str(pool + 60),
        "HETEROFLOW_SCHEDULER_INTERVAL_S": "0.2",
        "HETEROFLOW_SNAPSHOT_INTERVAL_S": "0.2",
        "HETEROFLOW_GATEWAY_POLL_INTERVAL_S": "0.5",
        "HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "1",
        "HETEROFLOW_LEADER_LEASE_TTL_S": "3",
        "HETEROFLOW_LEADER_RENEW_INTERVAL_S": "1",
        "HETEROFLOW_ROLLOUT_INTERVAL_S": "0.25",
        "HETEROFLOW_ROLLOUT_LEASE_TTL_S": str(ttl_s),
        "HETEROFLOW_ROLLOUT_RENEW_S": "1",
        "HETEROFLOW_ROLLOUT_SCAN_INTERVAL_S": str(scan_s),
        "HETEROFLOW_ROLLOUT_DRAIN_TIMEOUT_S": "10",
    }
    port_a, port_b, gw_port = free_port(), free_port(), free_port()
    url_a, url_b = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    st = Stack(tmp_path, models, model_file, url_b, f"http://127.0.0.1:{gw_port}")
    try:
        a = spawn("server-a", ["server", "--port", str(port_a)],
                  {**common, "HETEROFLOW_DATA_DIR": str(tmp_path / "a")}, tmp_path)
        st.procs.append(a)
        wait_for(lambda: httpx.get(url_a + "/healthz", timeout=1).status_code == 200, 30, "A")
        st.procs.append(spawn("server-b", ["server", "--port", str(port_b)],
                              {**common, "HETEROFLOW_DATA_DIR": str(tmp_path / "b")},
                              tmp_path))
        wait_for(lambda: httpx.get(url_b + "/healthz", timeout=1).status_code == 200, 30, "B")
        st.procs.append(spawn("agent", ["agent"], {
            "HETEROFLOW_AGENT_SERVER_URL": url_b,
            "HETEROFLOW_AGENT_NODE_TOKEN": NODE_TOKEN,
            "HETEROFLOW_AGENT_NODE_NAME": "pg-node",
            "HETEROFLOW_AGENT_CONFIG_FILE": str(tmp_path / "node.json"),
            "HETEROFLOW_AGENT_WORK_DIR": str(tmp_path / "agent"),
            "HETEROFLOW_AGENT_HEARTBEAT_INTERVAL_S": "0.3",
            "HETEROFLOW_AGENT_CPU_THREADS": "1",
            "HETEROFLOW_AGENT_RUNTIME": "process",
        }, tmp_path))
        st.procs.append(spawn("gateway", ["gateway", "--server", url_b, "--token",
                                          GATEWAY_TOKEN, "--port", str(gw_port)],
                              {"HETEROFLOW_GATEWAY_POLL_INTERVAL_S": "0.5",
                               "HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "1"}, tmp_path))
        wait_for(lambda: httpx.get(st.gateway_url + "/v1/models", timeout=1).status_code
                 == 401, 30, "gateway up")
        r = httpx.post(url_b + "/api/v1/auth/login",
                       json={"username": "admin", "password": ADMIN_PASSWORD})
        st.token = r.json()["access_token"]
        servers = st.api("GET", "/api/v1/servers").json()
        leader = servers["leader"]
        assert leader is not None
        wait_for(lambda: st.api("GET", "/api/v1/nodes").json(), 30, "node registered")
        group_id, key, model = service(st, "pgroll")
        load = Load(st.gateway_url, key, model).start()
        try:
            wait_for(lambda: load.ok >= 16, 30, "the load to flow")
            # submitted to A: A holds the update's lease and drives it
            r = httpx.put(
                url_a + f"/api/v1/task-groups/{group_id}/update", headers=st.headers,
                json={"image": "ghcr.io/ggml-org/llama.cpp:server-b2"}, timeout=30,
            )
            assert r.status_code == 200, r.text
            wait_for(lambda: "new generation starting" in (
                st.group(group_id)["rolling_update_message"] or ""), 10, "A to start it", 0.05)
            a.popen.send_signal(signal.SIGKILL)  # A dies holding the lease
            a.popen.wait(10)
            killed = time.monotonic()
            g = follow(st, group_id, {"failed", "done"}, 30)
            failed_after = time.monotonic() - killed
            assert g["rolling_update_state"] == "failed", g
            assert "stopped renewing its lease" in g["rolling_update_message"]
            assert leader in g["rolling_update_message"]  # the leader was the holder
            assert failed_after <= ttl_s + scan_s + 3, failed_after
            print(f"update failed {failed_after:.1f} s after kill -9 of its holder "
                  f"(lease TTL {ttl_s:g} s, scan every {scan_s:g} s)")
            # resubmitted to the survivor: it completes
            r = st.api("PUT", f"/api/v1/task-groups/{group_id}/update",
                       json={"image": "ghcr.io/ggml-org/llama.cpp:server-b2"})
            assert r.status_code == 200, r.text
            assert r.json()["current_generation"] == 3
            g = follow(st, group_id, {"failed", "done"}, 120)
            assert g["rolling_update_state"] == "done", f"{g}\n{st.logs()}"
        finally:
            load.finish()
        print(f"kill -9 of the holder: {load.summary()}")
        assert load.failures == [], "\n".join(load.failures[:20])
        assert {t["generation"] for t in g["tasks"]} == {3}
    finally:
        for p in reversed(st.procs):
            p.stop()
