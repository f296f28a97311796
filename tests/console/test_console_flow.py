"""The console end to end, in a real browser against a real stack: an operator sees the
running service's card, deploys a scanned model through the create dialog after its dry
run, follows the new service's logs and timeline, rotates its key and calls the gateway
with the new one through the OpenAI SDK; sees an update's failure and its faults; turns
on the dedup switch and sees a create reuse the service; and a member of another tenant
sees none of it."""

from __future__ import annotations

import re

import openai
import pytest
from playwright.sync_api import expect

from tests.console.conftest import Console
from tests.e2e.conftest import Stack, wait_for

pytestmark = pytest.mark.e2e

MEMBER_PASSWORD = "console-member-pass"


def chat(base_url: str, key: str, model: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    return r.choices[0].message.content or "(empty)"


def answered(base_url: str, key: str, model: str) -> str | None:
    """The reply, or None while the gateway does not know the key yet."""
    try:
        return chat(base_url, key, model)
    except openai.AuthenticationError:
        return None


def refused(base_url: str, key: str, model: str) -> bool:
    try:
        chat(base_url, key, model)
    except openai.AuthenticationError:
        return True
    return False


def usage_tokens(st: Stack) -> int:
    r = st.api("GET", "/api/v1/usage", params={"group_by": "service"})
    return int(r.json()["total"]["total_tokens"])


@pytest.mark.feature("O1", "O2", "O3", "O4", "O5")
def test_operator_flow_and_another_tenant_sees_nothing(
    console: Console, console_stack: Stack, request: pytest.FixtureRequest
) -> None:
    st, page = console_stack, console.page
    demo = st.create_service("demo")
    st.wait_status(demo["id"], "running")

    # --- O1: the running service's card, live -------------------------------------
    console.login("admin")
    card = page.locator(f'article[data-id="{demo["id"]}"]')
    expect(card).to_have_attribute("data-status", "running")
    expect(card.locator(".badge")).to_have_text("running")
    expect(card.locator("h2")).to_have_text("demo")
    facts = {
        "gpus": "0 (CPU)",
        "parallelism": "single",
        "replicas": "min 1 · now 1 · max 1",
        "autoscale": "off",
        "api": f"on · {demo['endpoint']}",
        "engine": "llamacpp server",  # recognised from ghcr.io/ggml-org/llama.cpp:server
    }
    for key, text in facts.items():
        expect(card.locator(f'dd[data-fact="{key}"]')).to_have_text(text)
    expect(card.locator(".model")).to_contain_text("demo-model")
    uptime = card.locator('dd[data-fact="uptime"]')
    expect(uptime).to_have_text(re.compile(r"^\d+(s|m \d\ds)$"))
    before = uptime.inner_text()
    expect(uptime).not_to_have_text(before)  # refreshed in place, no reload

    # --- O4 + O2: deploy a scanned model; the dry run first, then create ---------------
    console.goto("#/models")
    console.shot("models")
    # a scanned model lies on the node's disk; a cached one would name its source (H9)
    expect(page.locator("section.panel", has_text="e2e-node").locator("tbody tr").first
           ).to_contain_text("on disk")
    page.get_by_role("button", name="Deploy tiny from e2e-node").click()
    dialog = page.locator("dialog.modal")
    expect(dialog.get_by_label("Model name")).to_have_value("tiny")
    expect(dialog.get_by_label("Model path")).to_have_value(str(st.model_file))
    dialog.get_by_label("Service name").fill("chat")
    dialog.get_by_label("GPUs per replica").fill("0")
    create = dialog.get_by_role("button", name="Create", exact=True)
    expect(create).to_be_disabled()  # no create before its dry run was shown
    dialog.get_by_role("button", name="Preview (dry run)").click()
    plan = dialog.locator("section.plan")
    expect(plan.locator('[data-plan="engine"]')).to_have_text("llamacpp")
    expect(plan.locator('[data-plan="engine-reason"]')).to_contain_text("llamacpp")
    expect(plan.locator('[data-plan="placement"]')).to_contain_text("e2e-node")
    expect(plan.locator('[data-plan="argv"]')).to_contain_text(str(st.model_file))
    # H8: the chosen engine's capabilities with their maturity labels (GET /api/v1/engines)
    chat_label = dialog.locator('.maturity[data-engine="llamacpp"] [data-capability="chat"]')
    expect(chat_label).to_have_attribute("data-label", "verified-ci-cpu")
    expect(chat_label).to_contain_text("verified in CI (CPU)")
    assert len(st.api("GET", "/api/v1/task-groups").json()) == 1  # the dry run wrote nothing
    console.shot("create-dialog", height=1250)
    expect(create).to_be_enabled()
    create.click()
    outcome = dialog.locator(".create-result .banner").first
    expect(outcome).to_have_attribute("data-level", "success")
    expect(outcome).to_contain_text("Created chat")
    first_key = dialog.get_by_label("API key").input_value()
    assert re.fullmatch(r"sk-[0-9a-f-]{36}", first_key), first_key
    expect(dialog.get_by_role("button", name="Copy")).to_be_visible()
    dialog.get_by_role("link", name="Open the service").click()

    # --- O3: its detail: replicas, live logs, timeline, key prefix, rotation ------------
    expect(page).to_have_url(re.compile(r"#/services/tg-[0-9a-f]+$"))
    chat_id = page.url.rsplit("/", 1)[1]
    expect(page.locator(".title-row .badge")).to_have_text("running", timeout=60_000)
    replicas = page.locator('section[aria-labelledby="sec-replicas"] tbody tr')
    expect(replicas).to_have_count(1)
    expect(replicas.locator("td").nth(3)).to_have_text("e2e-node")  # the node column
    expect(page.locator("pre.log")).to_contain_text("listening on", timeout=30_000)
    timeline = page.locator("ol.timeline")
    expect(timeline).to_contain_text("placed on e2e-node")
    expect(timeline).to_contain_text("health check passed")
    prefix = page.locator('[data-testid="key-prefix"]')
    expect(prefix).to_have_text(re.compile(r"^sk-[0-9a-f]{4}…$"))
    assert first_key.startswith(prefix.inner_text()[:-1])
    snippet = page.locator('[data-testid="snippet-python"]')
    expect(snippet).to_contain_text(first_key)  # the key just shown, in this tab only
    expect(snippet).to_contain_text('model="tiny"')
    console.shot("service-detail")

    page.get_by_role("button", name="Rotate key").click()
    page.locator("dialog.modal").get_by_role("button", name="Rotate").click()
    new_key = page.get_by_label("New API key").input_value()
    assert re.fullmatch(r"sk-[0-9a-f-]{36}", new_key) and new_key != first_key
    expect(prefix).to_have_text(new_key[:7] + "…")
    expect(snippet).to_contain_text(new_key)
    base_url = page.locator('[data-testid="base-url"]').inner_text()
    assert base_url == st.server_url + "/v1"
    assert wait_for(lambda: answered(base_url, new_key, "tiny"), 20, "the new key to answer")
    assert wait_for(lambda: refused(base_url, first_key, "tiny"), 20, "the old key refused")

    # --- O3: an update that fails: the failure reason and the faults ------------------------
    console.goto(f"#/services/{demo['id']}")
    page.get_by_role("button", name="Update…").click()
    upd = page.locator("dialog.modal")
    upd.get_by_label("Image").fill("ghcr.io/ggml-org/llama.cpp:server-b3")
    upd.get_by_label("Engine arguments").fill("--no-such-flag")
    upd.get_by_role("button", name="Start the update").click()
    rollout = page.locator(".rollout")
    expect(rollout.locator(".badge")).to_have_text("failed", timeout=60_000)
    reason = page.locator('[data-testid="rollout-message"]')
    expect(reason).to_contain_text("Why it failed:")
    expect(reason).to_contain_text("--no-such-flag")
    expect(reason).to_contain_text("rolled back: generation 1 serves")
    fault = timeline.locator('li.fault[data-kind="fault.engine_exited"]').first
    expect(fault).to_contain_text("engine exited with code 2")
    expect(timeline.locator('li.fault[data-kind="rollout.failed"]')).to_have_count(1)
    expect(page.locator(".title-row .badge")).to_have_text("running")  # generation 1 serves
    console.shot("service-detail-failed-update")

    # --- O5: the platform switch, then O2's dedup outcome through the drop-down ----------
    console.goto("#/admin")
    switch = page.get_by_role("switch", name="Reuse a running service", exact=True)
    expect(switch).not_to_be_checked()
    switch.check()
    request.addfinalizer(  # the other tests on this stack expect no reuse
        lambda: st.api("PUT", "/api/v1/platform-settings", json={"inference_dedup_enabled": False})
    )
    wait_for(
        lambda: st.api("GET", "/api/v1/platform-settings").json()["inference_dedup_enabled"],
        10,
        "the switch to be saved",
    )
    expect(switch).to_be_checked()
    console.shot("control-panel")

    console.goto("#/services")
    page.get_by_role("button", name="New service").click()
    dialog = page.locator("dialog.modal")
    dialog.get_by_label("Scanned model").select_option(index=1)
    expect(dialog.get_by_label("Model name")).to_have_value("tiny")
    expect(dialog.get_by_label("Model path")).to_have_value(str(st.model_file))
    dialog.get_by_label("Service name").fill("chat-again")
    dialog.get_by_label("GPUs per replica").fill("0")
    dialog.get_by_role("button", name="Preview (dry run)").click()
    planned = dialog.locator("section.plan .banner").first
    expect(planned).to_have_attribute("data-level", "success")
    expect(planned).to_contain_text(f"'chat' ({chat_id})")
    dialog.get_by_role("button", name="Create", exact=True).click()
    outcome = dialog.locator(".create-result .banner").first
    expect(outcome).to_have_attribute("data-level", "success")
    expect(outcome).to_contain_text("Reused:")
    expect(outcome).to_contain_text("no new engine starts")
    reuse_key = dialog.get_by_label("API key").input_value()
    assert wait_for(lambda: answered(base_url, reuse_key, "tiny"), 20, "the reuse key to answer")
    dialog.get_by_role("button", name="Close", exact=True).click()
    expect(page.locator("article.service-card")).to_have_count(2)  # the reuse made none
    console.shot("services")

    # --- nodes and usage pages show the stack ---------------------------------------------
    console.goto("#/nodes")
    node = page.locator("section.node", has_text="e2e-node")
    expect(node.locator(".badge")).to_have_text("online")
    expect(node).to_contain_text("llamacpp")
    console.shot("nodes")
    wait_for(lambda: usage_tokens(st) > 0, 20, "the gateway's usage to be recorded")
    console.goto("#/usage")
    expect(page.locator("table.grid")).to_contain_text("chat")
    expect(page.locator("svg.bars rect").first).to_be_visible()
    console.shot("usage")
    with page.expect_download() as dl:
        page.get_by_role("button", name="Export CSV").click()
    csv = dl.value.path().read_text()
    assert csv.splitlines()[0].startswith("service_id,day,requests"), csv[:200]
    assert chat_id in csv

    # --- another tenant's member sees none of it ----------------------------------------
    tenant = st.api("POST", "/api/v1/tenants", json={"name": "other"}).json()
    r = st.api(
        "POST",
        "/api/v1/users",
        json={"username": "olga", "password": MEMBER_PASSWORD, "tenant_id": tenant["id"]},
    )
    assert r.status_code == 201, r.text
    console.logout()
    console.login("olga", MEMBER_PASSWORD)
    expect(page.locator("p.empty")).to_be_visible()
    expect(page.locator("article.service-card")).to_have_count(0)
    expect(page.get_by_role("link", name="Control panel")).to_have_count(0)
    console.goto(f"#/services/{chat_id}")
    expect(page.locator("main")).to_contain_text("does not exist (any more), or it is not yours")


@pytest.mark.feature("O2", "E1")
def test_a_failed_service_can_be_started_again_from_its_page(
    console: Console, console_stack: Stack
) -> None:
    """Issue 33: a failed service's header said "start the service to try again" while
    the Start button was hidden (it showed only for a stopped one)."""
    st, page = console_stack, console.page
    g = st.create_service("broken", task={
        "image": "ghcr.io/ggml-org/llama.cpp:server", "gpu_required": 0,
        "model_path": str(st.model_file), "engine_args": ["--no-such-flag"],
    })

    def gave_up() -> dict[str, object] | None:
        got = st.group(g["id"])
        return got if "recovery gave up" in str(got.get("status_message")) else None

    wait_for(gave_up, 120, "recovery to give up on the broken service", 0.5)
    console.login("admin")
    console.goto(f"#/services/{g['id']}")
    start_button = page.get_by_role("button", name="Start", exact=True)
    expect(start_button).to_be_visible()
    before = {t["id"] for t in st.group(g["id"])["tasks"]}
    start_button.click()

    def restarted() -> bool:
        tasks = st.group(g["id"])["tasks"]
        return any(t["id"] not in before and t["rebuild_count"] == 0 for t in tasks)

    wait_for(restarted, 20, "a fresh task queued by the start")
    assert st.api("DELETE", f"/api/v1/task-groups/{g['id']}").status_code == 204
