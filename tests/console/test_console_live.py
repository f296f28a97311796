"""The service page's live charts (issue 33) in a real browser against a real stack:
traffic through the gateway to a real llama.cpp service makes the request-rate line
rise without a reload; each replica's load is shown, with "n/a" for the prefix-cache hit
rate llama.cpp does not report; a scaling and a rolling update are marked on the time
axis."""

from __future__ import annotations

import threading

import openai
import pytest
from playwright.sync_api import expect

from tests.console.conftest import Console
from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e


def _traffic(base_url: str, key: str, model: str, stop: threading.Event) -> list[int]:
    done = [0]

    def loop() -> None:
        client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30)
        while not stop.is_set():
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                temperature=0,
            )
            done[0] += 1

    threading.Thread(target=loop, daemon=True).start()
    return done


def test_the_request_rate_rises_on_the_service_page_while_traffic_flows(
    console: Console, console_stack: Stack
) -> None:
    st, page = console_stack, console.page
    made = st.create_service("live")
    st.wait_status(made["id"], "running", timeout_s=120)
    console.login("admin")
    console.goto(f"#/services/{made['id']}")
    live = page.locator('[data-testid="live"]')
    expect(live).to_have_attribute("data-loaded", "true")
    rate = page.locator('[data-testid="chart-requests"]')
    expect(rate).to_be_visible()
    assert float(rate.get_attribute("data-max") or 0) == 0  # nothing sent yet

    stop = threading.Event()
    sent = _traffic(st.gateway_url + "/v1", made["api_key"], "live-model", stop)
    try:
        # two samples (10 s apart) with traffic between them give a rate; the page
        # polls every 5 s: the line rises in place, the page is never reloaded
        page.evaluate("() => { window.__noReload = true; }")
        expect(rate).not_to_have_attribute("data-max", "0", timeout=60_000)
        assert float(rate.get_attribute("data-max") or 0) > 0
        assert sent[0] > 0
        assert page.evaluate("() => window.__noReload") is True
        row = page.locator('[data-testid="replica-load"] tbody tr')
        expect(row).to_have_count(1)
        expect(row.locator("td").nth(1)).to_have_text("running")
        expect(row.locator("td").last).to_have_text("n/a")  # llama.cpp: no prefix counters
        expect(page.locator('[data-testid="chart-latency"]')).not_to_have_attribute(
            "data-max", "0"
        )
        expect(page.locator('[data-testid="chart-tokens"]')).not_to_have_attribute(
            "data-max", "0"
        )
    finally:
        stop.set()
    # a scaling is an event on the time axis
    r = st.api("PUT", f"/api/v1/task-groups/{made['id']}/scale-policy",
               json={"enabled": False, "max_replicas": 2})
    assert r.status_code == 200, r.text
    r = st.api("PUT", f"/api/v1/task-groups/{made['id']}/scale", json={"replicas": 2})
    assert r.status_code == 200, r.text
    expect(page.locator('[data-testid="chart-replicas"] .event-mark').first).to_be_attached(
        timeout=20_000
    )
    # a rolling update's steps are marked on the same axis (issue 33's proof)
    r = st.api("PUT", f"/api/v1/task-groups/{made['id']}/update",
               json={"strategy": "rolling",
                     "engine_args": ["--embeddings", "-np", "2", "-c", "512"]})
    assert r.status_code == 200, r.text
    expect(
        page.locator('[data-testid="chart-replicas"] .event-mark title', has_text="rollout.started")
    ).to_be_attached(timeout=20_000)
    console.shot("service-live")


def test_the_node_page_charts_the_host_and_the_fleet_overview_counts_services(
    console: Console, console_stack: Stack
) -> None:
    st, page = console_stack, console.page
    made = st.create_service("fleet")
    st.wait_status(made["id"], "running", timeout_s=120)
    console.login("admin")
    node = st.api("GET", "/api/v1/nodes").json()[0]
    console.goto("#/nodes")
    chart = page.locator(f'[data-testid="node-live-{node["id"]}"] [data-testid="chart-node"]')
    # the leader samples the node's heartbeat every 10 s; the panel polls every 10 s
    expect(chart).not_to_have_attribute("data-points", "0", timeout=40_000)
    console.goto("#/fleet")
    expect(page.get_by_role("heading", name="Fleet overview")).to_be_visible()
    states = page.get_by_role("region", name="Services by state")
    expect(states.locator("tbody tr", has_text="running")).to_have_count(1)
    running = states.locator("tbody tr", has_text="running").locator("td").last
    assert int(running.inner_text()) >= 1
