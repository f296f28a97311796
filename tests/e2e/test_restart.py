"""A restart of ``heteroflow up`` brings every service back (issue 26, item 4).

Real ``up`` processes on one data directory, the real llama.cpp engine on the tiny
model: the demo and two more services, one of them asleep. After a clean stop (Ctrl-C)
and after a hard kill (SIGKILL: the engines die with ``up``), the next ``up`` starts the
running ones again on the placements they had — the same tasks, no ``failed`` on any
timeline, no fault, no rebuild counted — and the sleeping one stays asleep until its
wake.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from heteroflow.models.tiny_gguf import write_tiny_gguf

from .conftest import wait_for
from .test_up import Up, engines_under

pytestmark = pytest.mark.e2e


class Api:
    """The management API of the ``up`` listening at ``base``, as admin."""

    def __init__(self, base: str, password: str) -> None:
        self.base = base
        r = httpx.post(
            base + "/api/v1/auth/login", json={"username": "admin", "password": password}
        )
        assert r.status_code == 200, r.text
        self.headers = {"Authorization": f"Bearer {r.json()['access_token']}"}

    def call(self, method: str, path: str, **kw: Any) -> httpx.Response:
        return httpx.request(method, self.base + path, headers=self.headers, timeout=30, **kw)

    def group(self, group_id: str) -> dict[str, Any]:
        return dict(self.call("GET", f"/api/v1/task-groups/{group_id}").json())

    def wait(self, group_id: str, status: str, timeout_s: float = 90) -> dict[str, Any]:
        def seen() -> dict[str, Any] | None:
            g = self.group(group_id)
            assert g["status"] != "failed", g
            return g if g["status"] == status else None

        return dict(wait_for(seen, timeout_s, f"{group_id} {status}", 0.3))

    def timeline(self, group_id: str) -> list[dict[str, Any]]:
        return list(self.call("GET", f"/api/v1/task-groups/{group_id}/events").json())


def create(api: Api, name: str, model: Path) -> dict[str, Any]:
    body = {
        "name": name,
        "model_name": f"{name}-model",
        "health_check": {"interval_seconds": 0.5, "start_period_seconds": 60},
        "task": {
            "image": "ghcr.io/ggml-org/llama.cpp:server",
            "gpu_required": 0,
            "model_path": str(model),
            "memory_mb": 512,
            "engine_args": ["-c", "512"],
        },
    }
    r = api.call("POST", "/api/v1/task-groups", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def answers(base: str, key: str, model: str) -> bool:
    client = openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=30)
    try:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    except (openai.APIStatusError, openai.APIConnectionError):
        return False
    return bool(reply.choices[0].message.content)


def tasks_of(api: Api, groups: dict[str, str]) -> dict[str, tuple[Any, ...]]:
    """Each group's current task: id, status, node, ports, rebuild count."""
    out = {}
    for name, group_id in groups.items():
        (t,) = api.group(group_id)["tasks"]
        ports = [p["host_port"] for p in t["ports"]]
        out[name] = (t["id"], t["node_id"], ports, t["rebuild_count"])
    return out


def assert_no_failure(api: Api, groups: dict[str, str]) -> None:
    for group_id in groups.values():
        timeline = api.timeline(group_id)
        assert [e for e in timeline if e["kind"].startswith("fault.")] == [], timeline
        assert [e for e in timeline if e.get("to_status") == "failed"] == [], timeline


@pytest.mark.feature("E1", "F1")
def test_a_restarted_up_brings_every_service_back_and_a_sleeping_one_asleep(
    tmp_path: Path,
) -> None:
    env = {"HETEROFLOW_CLI_DIR": str(tmp_path / "cli")}
    models = tmp_path / "models"  # up's own models directory: its agent allows it
    first = Up(tmp_path, env)
    try:
        base, demo_key = first.ready()
        password = re.search(r"admin password \(shown once\): (\S+)", first.text)
        assert password, first.text
        api = Api(base, password.group(1))
        demo = re.search(r"deploying \S+ from \S+ as (tg-[0-9a-f]+)", first.text)
        assert demo, first.text
        # other model files than the demo's: the same file would be reused (dedup)
        made = {n: create(api, n, write_tiny_gguf(models / f"{n}.gguf")) for n in ("ra", "rb")}
        groups = {"demo": demo.group(1), **{n: g["id"] for n, g in made.items()}}
        keys = {"demo": demo_key, **{n: g["api_key"] for n, g in made.items()}}
        api.wait(groups["ra"], "running")
        api.wait(groups["rb"], "running")
        r = api.call("POST", f"/api/v1/task-groups/{groups['rb']}/sleep")
        assert r.status_code in (200, 202), r.text
        api.wait(groups["rb"], "sleeping")
        before = tasks_of(api, groups)
    finally:
        assert first.stop() == 0, first.text
    assert engines_under(tmp_path) == []

    second = Up(tmp_path, env)
    try:
        base, _ = second.ready()  # the demo answers: up says how to call it
        api = Api(base, password.group(1))
        api.wait(groups["ra"], "running")
        assert api.group(groups["rb"])["status"] == "sleeping"
        assert tasks_of(api, groups) == before  # the same tasks, where they were
        assert_no_failure(api, groups)
        wait_for(lambda: answers(base, keys["demo"], "heteroflow-tiny"), 30, "the demo")
        wait_for(lambda: answers(base, keys["ra"], "ra-model"), 30, "ra answers")
        # killed hard: the engines die with it, nothing is reported
        second.proc.kill()
        second.proc.wait(10)
    finally:
        if second.proc.poll() is None:
            second.stop()
    wait_for(lambda: engines_under(tmp_path) == [], 15, "the engines to die with up")

    third = Up(tmp_path, env)
    try:
        base, _ = third.ready()
        api = Api(base, password.group(1))
        api.wait(groups["ra"], "running")
        assert api.group(groups["rb"])["status"] == "sleeping"
        assert tasks_of(api, groups) == before
        assert_no_failure(api, groups)
        back = [
            e for e in api.timeline(groups["ra"])
            if e.get("to_status") == "scheduled" and "agent came back" in e["message"]
        ]
        assert back, api.timeline(groups["ra"])  # the new agent found it gone, said so
        started = time.monotonic()
        r = api.call("POST", f"/api/v1/task-groups/{groups['rb']}/wake")
        assert r.status_code in (200, 202), r.text
        api.wait(groups["rb"], "running")
        wait_for(lambda: answers(base, keys["rb"], "rb-model"), 30, "the woken one answers")
        print(f"wake after restart -> answer: {time.monotonic() - started:.1f} s")
        assert tasks_of(api, groups) == before  # woken where it slept
        assert_no_failure(api, groups)
    finally:
        assert third.stop() == 0, third.text
    assert engines_under(tmp_path) == []
