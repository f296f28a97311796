"""Hub tokens per tenant (issue 29 item 1, H9): who manages which, the token sealed at
rest and never shown (its hint only), validation naming the field; create and dry run
resolving a private repository with the creating tenant's token (its own before the
platform's, the platform's before the server's setting); the claim handing the task
tenant's token to the agent of the node that runs it, and that agent fetching with it —
on SQLite and PostgreSQL.

The hub is ``testing.model_hub``'s stand-in on the loopback (no test machine reaches
huggingface.co); its private repositories answer 401 to any other token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr
from sqlalchemy import select

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.fetching import fetch_model, token_for
from heteroflow.agent.inventory import NvmlDiscovery
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.clock import FakeClock
from heteroflow.core.model_sources import parse_model_source
from heteroflow.db.tables import AuditRecord, Event, HubToken, Task
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.tenancy import hub_tokens
from heteroflow.services.tenancy.registry_credentials import Sealer
from heteroflow.settings import AgentSettings
from heteroflow.testing.model_hub import ModelHub, Repo, serving

from .conftest import NODE_TOKEN, Api

pytestmark = pytest.mark.feature("H9")

TOKENS = "/api/v1/hub-tokens"
TENANT_TOKEN = "hf_tenantAAAAtoken0123456789wxyz"
PLATFORM_TOKEN = "hf_platformPPPPtoken0123456789pq"
MS_TOKEN = "ms-session-0123456789-abcdefghij"
CONFIG = b'{"model_type": "llama"}'
SECRETS = (TENANT_TOKEN, PLATFORM_TOKEN, MS_TOKEN)


@pytest.fixture
def hub_url() -> Iterator[str]:
    hub = ModelHub(repos={
        "org/private": Repo({"config.json": CONFIG}, token=TENANT_TOKEN),
        "org/platform": Repo({"config.json": CONFIG}, token=PLATFORM_TOKEN),
        "org/public": Repo({"config.json": CONFIG}),
        "org/ms-private": Repo({"config.json": CONFIG}, token=MS_TOKEN),
    })
    with serving(hub) as url:
        yield url


def tenant_admin(api: Api, admin: dict[str, str], tenant: str, role: str = "tenant_admin",
                 name: str = "") -> dict[str, Any]:
    t = api.client.post("/api/v1/tenants", json={"name": tenant}, headers=admin)
    tenant_id = t.json()["id"] if t.status_code == 201 else next(
        x["id"] for x in api.client.get("/api/v1/tenants", headers=admin).json()
        if x["name"] == tenant
    )
    name = name or f"{tenant}-{role}"
    u = api.client.post(
        "/api/v1/users",
        json={"username": name, "password": "member-pass-1", "tenant_id": tenant_id,
              "role": role},
        headers=admin,
    )
    assert u.status_code == 201, u.text
    return {"headers": api.login(name, "member-pass-1"), "tenant_id": tenant_id}


def create(api: Api, headers: dict[str, str], **body: Any) -> Any:
    return api.client.post(TOKENS, json={"hub": "hf", "token": TENANT_TOKEN, **body},
                           headers=headers)


def group(model_path: str, name: str = "sourced") -> dict[str, Any]:
    return {
        "name": name, "model_name": name,
        "task": {"image": "vllm/vllm-openai:v0.11.2", "engine": "vllm", "gpu_required": 1,
                 "model_path": model_path},
    }


def test_operator_manages_tokens_and_sees_only_a_hint(api: Api) -> None:
    admin = api.login()
    r = create(api, admin)
    assert r.status_code == 201, r.text
    tok = r.json()
    assert tok["id"].startswith("ht-") and tok["tenant_id"] == "" and tok["hub"] == "hf"
    assert tok["token_hint"] == "hf_…wxyz"
    assert set(tok) == {"id", "tenant_id", "hub", "token_hint", "created_by", "created_at",
                        "updated_at"}
    listed = api.client.get(TOKENS, headers=admin)
    assert listed.json() == [tok]
    changed = api.client.patch(f"{TOKENS}/{tok['id']}", json={"token": PLATFORM_TOKEN},
                               headers=admin)
    assert changed.status_code == 200, changed.text
    assert changed.json()["token_hint"] == "hf_…" + PLATFORM_TOKEN[-4:]
    short = api.client.patch(f"{TOKENS}/{tok['id']}", json={"token": "shorttok"}, headers=admin)
    assert short.json()["token_hint"] == "…"  # 4 of 8 characters would be half of it
    shown = api.client.get(f"{TOKENS}/{tok['id']}", headers=admin)
    for answer in (r, listed, changed, shown, api.client.get("/api/v1/openapi.json")):
        assert not any(t in answer.text for t in SECRETS)
    assert "/api/v1/hub-tokens" in api.client.get("/api/v1/openapi.json").json()["paths"]
    assert api.client.delete(f"{TOKENS}/{tok['id']}", headers=admin).status_code == 204
    assert api.client.get(f"{TOKENS}/{tok['id']}", headers=admin).status_code == 404
    with api.app.db.session() as s:  # audited (who, what), never with a body
        audited = list(s.scalars(select(AuditRecord).where(AuditRecord.path.like(f"{TOKENS}%"))))
        assert [(a.method, a.status) for a in audited] == [
            ("POST", 201), ("PATCH", 200), ("PATCH", 200), ("DELETE", 204),
        ]
        rows = [str(getattr(a, c.name)) for a in audited for c in AuditRecord.__table__.columns]
        assert not any(t in v for v in rows for t in SECRETS)


def test_the_token_is_sealed_at_rest_for_its_own_row(api: Api) -> None:
    admin = api.login()
    tok = create(api, admin).json()
    with api.app.db.session() as s:
        row = s.get(HubToken, tok["id"])
        assert row is not None
        stored = [str(getattr(row, c.name)) for c in HubToken.__table__.columns]
        assert not any(TENANT_TOKEN in v for v in stored)  # no column holds it in clear
        assert row.token_sealed.startswith("v1.")
        sealer: Sealer = api.app.sealer
        assert sealer.open(row.token_sealed, row.id) == TENANT_TOKEN
        for other in ("ht-000000000000", "rc-" + row.id[3:]):  # another row, another table
            with pytest.raises(ValueError, match="another"):
                sealer.open(row.token_sealed, other)
        with pytest.raises(ValueError, match="another"):
            Sealer("some other platform secret").open(row.token_sealed, row.id)


def test_tenant_admins_manage_their_own_tenant_only_and_members_none(api: Api) -> None:
    admin = api.login()
    ta = tenant_admin(api, admin, "team-a")
    tb = tenant_admin(api, admin, "team-b")
    member = tenant_admin(api, admin, "team-a", role="member")
    platform = create(api, admin).json()
    own = create(api, ta["headers"])
    assert own.status_code == 201 and own.json()["tenant_id"] == ta["tenant_id"], own.text
    for asked in (tb["tenant_id"], ""):  # another tenant's, or the platform's
        r = create(api, ta["headers"], tenant_id=asked)
        assert r.status_code == 403 and r.json()["error"]["field"] == "tenant_id", r.text
    assert [t["id"] for t in api.client.get(TOKENS, headers=ta["headers"]).json()] == [
        own.json()["id"]
    ]
    assert api.client.get(TOKENS, headers=tb["headers"]).json() == []
    for tid in (own.json()["id"], platform["id"]):
        assert api.client.get(f"{TOKENS}/{tid}", headers=tb["headers"]).status_code == 404
        r = api.client.patch(f"{TOKENS}/{tid}", json={"token": MS_TOKEN}, headers=tb["headers"])
        assert r.status_code == 404
        assert api.client.delete(f"{TOKENS}/{tid}", headers=tb["headers"]).status_code == 404
    assert api.client.get(f"{TOKENS}/{platform['id']}", headers=ta["headers"]).status_code == 404
    assert api.client.get(TOKENS, headers=member["headers"]).status_code == 403
    assert create(api, member["headers"]).status_code == 403
    r = api.client.patch(f"{TOKENS}/{own.json()['id']}", json={"token": MS_TOKEN},
                         headers=member["headers"])
    assert r.status_code == 403
    assert len(api.client.get(TOKENS, headers=admin).json()) == 2
    r = create(api, admin, tenant_id=tb["tenant_id"])
    assert r.status_code == 201 and r.json()["tenant_id"] == tb["tenant_id"]
    r = create(api, admin, tenant_id="tn-000000000000")
    assert r.status_code == 404 and r.json()["error"]["field"] == "tenant_id"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"hub": "github"}, "hub"),
        ({"hub": "url"}, "hub"),
        ({"token": "short"}, "token"),
        ({"token": "has a space in it"}, "token"),
        ({"token": 123456789}, "token"),
        ({"token": "x\u0000yyyyyyyy"}, "token"),
        ({"tenant_id": "a b"}, "tenant_id"),
        ({"extra": 1}, "extra"),
    ],
)
def test_bad_input_names_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    admin = api.login()
    r = create(api, admin, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
    assert TENANT_TOKEN not in r.text


def test_one_token_per_tenant_and_hub(api: Api) -> None:
    admin = api.login()
    first = create(api, admin).json()
    again = create(api, admin, token=PLATFORM_TOKEN)
    assert again.status_code == 409 and again.json()["error"]["field"] == "hub", again.text
    assert create(api, admin, hub="modelscope", token=MS_TOKEN).status_code == 201
    r = api.client.patch(f"{TOKENS}/{first['id']}", json={}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "token"
    r = api.client.patch(f"{TOKENS}/{first['id']}", json={"token": MS_TOKEN, "hub": "hf"},
                         headers=admin)
    assert r.status_code == 400 and r.json()["error"]["field"] == "hub"  # not changeable


def resolve(api: Api, headers: dict[str, str], source: str, dry: bool = True,
            name: str = "sourced") -> Any:
    return api.client.post(f"/api/v1/task-groups?dry_run={str(dry).lower()}",
                           json=group(source, name), headers=headers)


def test_create_resolves_a_private_repo_with_the_tenants_own_token(
    api: Api, hub_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api.app.settings.hf_endpoint = hub_url
    api.app.settings.modelscope_endpoint = hub_url
    admin = api.login()
    ta = tenant_admin(api, admin, "team-a")
    tb = tenant_admin(api, admin, "team-b")
    # without a token: a 400 naming the field, for the dry run and the create alike
    for dry in (True, False):
        r = resolve(api, ta["headers"], "hf://org/private", dry)
        assert r.status_code == 400 and r.json()["error"]["field"] == "task.model_path", r.text
        assert "the token cannot read it" in r.json()["error"]["message"]
    # the platform's (the wrong one for this repository), and team-a's own: its own wins
    assert create(api, admin, token=PLATFORM_TOKEN).status_code == 201
    assert create(api, ta["headers"]).status_code == 201
    assert resolve(api, ta["headers"], "hf://org/private").status_code == 200
    created = resolve(api, ta["headers"], "hf://org/private", dry=False, name="made")
    assert created.status_code == 201, created.text
    # team-b has none of its own: the platform's opens the platform's repository only
    assert resolve(api, tb["headers"], "hf://org/platform").status_code == 200
    assert resolve(api, tb["headers"], "hf://org/private").status_code == 400
    # a row beats the server's own setting; the setting applies where no row does
    api.app.settings.hub_token = SecretStr(TENANT_TOKEN)
    assert resolve(api, tb["headers"], "hf://org/private").status_code == 400
    # one hub's token is never another's: ModelScope has none yet, then team-a's own
    assert resolve(api, ta["headers"], "modelscope://org/ms-private").status_code == 400
    assert create(api, ta["headers"], hub="modelscope", token=MS_TOKEN).status_code == 201
    assert resolve(api, ta["headers"], "modelscope://org/ms-private").status_code == 200
    assert not any(t in caplog.text for t in SECRETS)


def beat(api: Api, name: str) -> str:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": name, "address": "127.0.0.1", "runtime": "docker",
              "inventory": {"gpus": [{"index": 0, "model": "A10", "memory_total_mb": 24576}],
                            "cpu_count": 4, "memory_total_mb": 16384,
                            "memory_available_mb": 16384}},
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    assert not any(t in r.text for t in SECRETS)  # a heartbeat reply: never
    return str(r.json()["node_id"])


def placed(api: Api, headers: dict[str, str], source: str, name: str) -> tuple[str, str]:
    """(task id, node id) of a new service's task, placed by a scheduler round."""
    g = api.client.post("/api/v1/task-groups", json=group(source, name), headers=headers)
    assert g.status_code == 201, g.text
    task_id = str(g.json()["tasks"][0]["id"])
    api.app.scheduler.run_round()
    with api.app.db.session() as s:
        task = s.get(Task, task_id)
        assert task is not None and task.node_id
        return task_id, task.node_id


def test_the_claim_carries_the_task_tenants_token_to_its_node_only(
    api: Api, hub_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    api.app.settings.hf_endpoint = hub_url
    admin = api.login()
    ta = tenant_admin(api, admin, "team-a")
    tb = tenant_admin(api, admin, "team-b")
    assert create(api, admin, token=PLATFORM_TOKEN).status_code == 201
    assert create(api, ta["headers"]).status_code == 201
    nodes = {beat(api, "node-a"), beat(api, "node-b")}
    a_task, a_node = placed(api, ta["headers"], "hf://org/private", "svc-a")
    b_task, b_node = placed(api, tb["headers"], "hf://org/public", "svc-b")
    elsewhere = next(iter(nodes - {a_node}))
    # another node asking for team-a's task gets no claim, and no token
    refused = api.agent_post(elsewhere, f"/api/v1/agent/tasks/{a_task}/claim", {})
    assert refused.status_code != 200 and TENANT_TOKEN not in refused.text
    a = api.agent_post(a_node, f"/api/v1/agent/tasks/{a_task}/claim", {})
    assert a.status_code == 200, a.text
    assert a.json()["hub_token"] == TENANT_TOKEN
    b = api.agent_post(b_node, f"/api/v1/agent/tasks/{b_task}/claim", {})
    assert b.status_code == 200 and b.json()["hub_token"] == PLATFORM_TOKEN  # none of its own
    assert "hub_token" not in repr(TaskAssignment.model_validate(a.json()))
    with api.app.db.session() as s:
        # a model that is no hub's gets none
        for path in ("https://example.com/m.gguf", "fleet://hf--org--x--0123456789abcdef",
                     "/data/models/x", "tiny.gguf"):
            assert hub_tokens.token_for_task(s, api.app.sealer, a_task, path) is None
        texts = [e.message for e in s.scalars(select(Event))]
    assert not any(t in m for m in texts for t in SECRETS)
    for read in (api.client.get("/api/v1/task-groups", headers=admin),
                 api.client.get(f"/api/v1/tasks/{a_task}", headers=admin)):
        assert not any(t in read.text for t in SECRETS)
    assert not any(t in caplog.text for t in SECRETS)


def test_a_token_sealed_under_another_secret_does_not_fail_the_claim(
    api: Api, hub_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    api.app.settings.hf_endpoint = hub_url
    admin = api.login()
    tok = create(api, admin).json()
    node = beat(api, "node-a")
    task_id, _ = placed(api, admin, "hf://org/public", "svc-x")
    with api.app.db.session() as s:  # as if restored beside another platform secret
        row = s.get(HubToken, tok["id"])
        assert row is not None
        row.token_sealed = Sealer("another platform secret").seal(TENANT_TOKEN, row.id)
    claimed = api.agent_post(node, f"/api/v1/agent/tasks/{task_id}/claim", {})
    assert claimed.status_code == 200 and claimed.json()["hub_token"] is None
    assert f"hub token {tok['id']}" in caplog.text and TENANT_TOKEN not in caplog.text


class _Launcher:
    runtime = type("R", (), {"name": "docker"})()

    def engines(self) -> dict[str, str]:
        return {}

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


def assignment(model_path: str, hub_token: str | None) -> TaskAssignment:
    return TaskAssignment(
        id="t-1", group_id="g-1", name="svc-0", status="starting", task_type="inference",
        model_name="svc", model_path=model_path, image="vllm/vllm-openai", engine="vllm",
        command=[], engine_args=[], env=[], ports=[], gpu_ids=[], gpu_required=0,
        memory_mb=0, health_check={}, hub_token=hub_token,
    )


async def test_the_agent_fetches_with_the_claims_token_before_its_own(
    tmp_path: Path, hub_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = AgentSettings(server_url="http://server.invalid", node_token=NODE_TOKEN,
                             node_name="node-a", work_dir=tmp_path / "node-a",
                             hf_endpoint=hub_url, model_resolve_timeout_s=3.0,
                             hub_token=SecretStr(PLATFORM_TOKEN))
    agent = Agent(settings, NodeConfig(model_scan_dirs=()), _Launcher(),  # type: ignore[arg-type]
                  FakeClock(), nvml=NvmlDiscovery(platform="none"))
    notes: list[str] = []

    async def report(task_id: str, status: str, message: str, **_: Any) -> None:
        notes.append(message)

    agent._report = report  # type: ignore[method-assign,assignment]
    try:
        hf = parse_model_source("hf://org/private")
        assert token_for(agent, hf, TENANT_TOKEN) == TENANT_TOKEN
        assert token_for(agent, hf) == PLATFORM_TOKEN  # an operator's pull: the node's
        assert token_for(agent, parse_model_source("https://example.com/m.gguf"),
                         TENANT_TOKEN) is None  # a web server never gets a hub token
        with pytest.raises(LaunchFailed, match="the token cannot read it"):  # the node's own
            await fetch_model(agent, assignment("hf://org/private", None))
        got = await fetch_model(agent, assignment("hf://org/private", TENANT_TOKEN))
        assert (Path(got.model_path) / "config.json").read_bytes() == CONFIG
    finally:
        await agent.client.aclose()
        if agent._http is not None:
            await agent._http.close()
    assert not any(t in caplog.text or any(t in n for n in notes) for t in SECRETS)
