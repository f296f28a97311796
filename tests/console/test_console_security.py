"""The console's page comes with a strict Content-Security-Policy that the browser
enforces, and text from the API that looks like markup is shown as text, never run."""

from __future__ import annotations

import httpx
import pytest
from playwright.sync_api import expect

from heteroflow.api.security_headers import CSP
from tests.console.conftest import Console
from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e

# A label value and an engine argument may hold any text: a member could store this.
PAYLOAD = '<img src=x onerror="window.__pwned=1">'


def test_csp_is_enforced_and_api_text_is_never_markup(
    console: Console, console_stack: Stack
) -> None:
    st, page = console_stack, console.page
    r = httpx.get(st.server_url + "/", headers={"Accept": "text/html"})
    assert r.headers["content-security-policy"] == CSP
    for directive in (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "connect-src 'self'",
        "frame-ancestors 'none'",
    ):
        assert directive in CSP.split("; ")
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY"  # frame-ancestors for older browsers
    assert r.headers["referrer-policy"] == "no-referrer"

    r = st.api(
        "POST",
        "/api/v1/task-groups",
        json={
            "name": "markup",
            "model_name": "markup-model",
            "labels": {"note": PAYLOAD},
            "task": {
                "image": "ghcr.io/ggml-org/llama.cpp:server",
                "gpu_required": 1,  # no node has a card: it stays pending, with the reason
                "model_path": "markup.gguf",  # a name, not the demo's file: never a dedup
                "engine_args": ["--chat-template", PAYLOAD],
            },
        },
    )
    assert r.status_code == 201, r.text
    group_id = r.json()["id"]
    try:
        console.login("admin")
        card = page.locator(f'article[data-id="{group_id}"]')
        expect(card.locator(".why")).to_contain_text("InsufficientResources")
        console.goto(f"#/services/{group_id}")
        expect(page.locator("main .kv").first).to_contain_text(f"note={PAYLOAD}")
        # why it waits, in the scheduler's words (which filter refused depends on the load)
        expect(page.locator(".status-message")).to_contain_text("InsufficientResources: 0/1 nodes")
        assert page.evaluate("() => document.querySelectorAll('main img').length") == 0
        assert page.evaluate("() => window.__pwned") is None

        # the policy is in force: a script written into the page by hand does not run
        with page.expect_console_message(
            lambda m: "Content Security Policy" in m.text and "inline script" in m.text
        ):
            ran = page.evaluate(
                """() => {
                    const s = document.createElement('script');
                    s.textContent = 'window.__inline = 1';
                    document.body.append(s);
                    return window.__inline === 1;
                }"""
            )
        assert ran is False
        refusals = [e for e in console.errors if "Content Security Policy" in e]
        assert refusals, console.errors
        console.errors[:] = [e for e in console.errors if e not in refusals]  # expected here
    finally:
        assert st.api("DELETE", f"/api/v1/task-groups/{group_id}").status_code in (200, 204)
