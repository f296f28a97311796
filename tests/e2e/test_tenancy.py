"""Tenancy end to end (issue 16): cross-tenant dedup on real engines, usage split.

Real ``heteroflow server``, process-runtime ``heteroflow agent`` (the real llama.cpp
engine on the tiny model) and a separate ``heteroflow gateway``; callers use the OpenAI
SDK. Tenants A and B are in one sharing group with both dedup switches on: B deploys the
model A already serves, no new engine starts, B's own key answers at once, A's still
answers, and the usage report splits it: tokens by tenant (a member sees only its own),
the engine's time to the owner of the service.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import psutil
import pytest

from .conftest import Stack, launch_stack, wait_for
from .test_spine import sdk, wait_routable

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    flush = {"HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "0.3"}
    with launch_stack(
        tmp_path_factory.mktemp("tenancy"), node_name="tenancy-node",
        server_env=flush, gateway_env=flush,
    ) as st:
        yield st


def _engines(st: Stack) -> int:
    """llama.cpp engine processes serving this stack's model file."""
    n = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "heteroflow.engines.llamacpp_server" in cmd and str(st.model_file) in " ".join(cmd):
            n += 1
    return n


def _ok(r: httpx.Response, status: int = 200) -> Any:
    assert r.status_code == status, r.text
    return r.json()


def _member(st: Stack, tenant_id: str, username: str) -> Stack:
    """``st`` logged in as a new member of ``tenant_id``."""
    body = {"username": username, "password": "member-pass-1", "tenant_id": tenant_id}
    _ok(st.api("POST", "/api/v1/users", json=body), 201)
    r = httpx.post(
        st.server_url + "/api/v1/auth/login",
        json={"username": username, "password": "member-pass-1"},
    )
    return dataclasses.replace(st, token=_ok(r)["access_token"])


def _chat(key: str, st: Stack, model: str) -> int:
    out = sdk(st.gateway_url, key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert out.choices[0].message.content and out.usage is not None
    return out.usage.total_tokens


@pytest.mark.feature("L2", "L4", "N4")
def test_a_tenant_in_the_sharing_group_reuses_the_loaded_model_with_its_own_key(
    stack: Stack,
) -> None:
    sg = _ok(stack.api("POST", "/api/v1/sharing-groups", json={"name": "lab"}), 201)
    tenants = {}
    for name in ("team-a", "team-b"):
        t = _ok(stack.api("POST", "/api/v1/tenants", json={"name": name}), 201)
        _ok(stack.api("POST", f"/api/v1/sharing-groups/{sg['id']}/tenants",
                      json={"tenant_id": t["id"]}))
        tenants[name] = t["id"]
    a, b = _member(stack, tenants["team-a"], "alice"), _member(stack, tenants["team-b"], "bob")
    on = {"inference_dedup_enabled": True, "cross_tenant_dedup_enabled": True}
    assert _ok(stack.api("PUT", "/api/v1/platform-settings", json=on)) == on

    first = a.create_service("llm")
    assert first.get("dedup") is None
    a.wait_status(first["id"], "running")
    wait_routable(stack, first["api_key"], "llm-model")
    engines = _engines(stack)
    assert engines == 1

    second = b.create_service("llm")  # the same model file and image, another tenant
    dedup = second["dedup"]
    assert (dedup["action"], dedup["level"], dedup["cross_tenant"]) == (
        "reused", "success", True,
    )
    # issue 26: B is answered in its own names, nothing of A's service
    assert (second["id"], dedup["group_id"], second["tasks"]) == ("", "", [])
    assert second["tenant_id"] == tenants["team-b"]
    assert second["api_key"] and second["api_key"] != first["api_key"]
    assert "no new engine starts" in dedup["message"]

    # B's own key answers as soon as the gateway's snapshot has it (within a poll)
    wait_routable(stack, second["api_key"], "llm-model")
    spent_b = _chat(second["api_key"], stack, "llm-model")
    spent_a = _chat(first["api_key"], stack, "llm-model")
    assert _engines(stack) == engines  # no engine started for B
    group = a.group(first["id"])
    assert len(group["tasks"]) == 1 and group["tenant_id"] == tenants["team-a"]

    # B's key is B's: it calls the reused service by B's route, not A's other models
    with pytest.raises(openai.NotFoundError):
        sdk(stack.gateway_url, second["api_key"]).chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=1
        )

    def by_tenant() -> dict[str, dict[str, Any]] | None:
        rows = _ok(stack.api("GET", "/api/v1/usage", params={"group_by": "tenant"}))["rows"]
        seen = {r["tenant_id"]: r for r in rows}
        both = all(t in seen for t in tenants.values())
        return seen if both and seen[tenants["team-b"]]["total_tokens"] >= spent_b else None

    usage = wait_for(by_tenant, 10, "both tenants' usage flushed", 0.2)
    # wait_routable's probes count too: at least the chats sent here, per tenant
    assert usage[tenants["team-a"]]["total_tokens"] >= spent_a
    assert usage[tenants["team-b"]]["requests"] >= 1
    mine = _ok(b.api("GET", "/api/v1/usage", params={"group_by": "tenant"}))["rows"]
    assert [r["tenant_id"] for r in mine] == [tenants["team-b"]]  # a member: its own only

    # the engine's time is the owner's (A's task, a CPU task: no card, task-seconds);
    # B, reusing it, is billed its tokens only
    rows = _ok(stack.api("GET", "/api/v1/usage", params={"group_by": "tenant", "gpu": "true"}))
    seen = {r["tenant_id"]: r for r in rows["rows"]}
    assert seen[tenants["team-a"]]["running_task_seconds"] > 0
    assert seen[tenants["team-a"]]["gpu_running_card_seconds"] == 0
    assert seen[tenants["team-b"]]["running_task_seconds"] == 0
    assert seen[tenants["team-b"]]["total_tokens"] >= spent_b
