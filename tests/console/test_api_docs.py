"""The API reference (/api/v1/docs, linked from the console's footer) works with no
network but the server's — Swagger UI is shipped in the package — under the same strict
Content-Security-Policy as the console, and no other page can frame it."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Route, expect

from tests.console.conftest import Console
from tests.e2e.conftest import Stack

pytestmark = pytest.mark.e2e

# every Content-Security-Policy violation of the page, as the page itself sees them
WATCH_CSP = """document.addEventListener('securitypolicyviolation', (e) =>
    (window.__csp ||= []).push(`${e.violatedDirective} ${e.blockedURI}`));"""


def test_the_api_reference_renders_offline_under_the_csp(
    console: Console, console_stack: Stack
) -> None:
    page = console.page
    assert urlsplit(console_stack.server_url).hostname == "127.0.0.1"
    elsewhere: list[str] = []

    def only_this_machine(route: Route) -> None:
        if urlsplit(route.request.url).hostname == "127.0.0.1":
            route.continue_()
        else:  # an offline install: a CDN cannot be reached
            elsewhere.append(route.request.url)
            route.abort()

    page.route("**/*", only_this_machine)
    page.add_init_script(WATCH_CSP)
    refusals: list[str] = []

    def on_console(msg: ConsoleMessage) -> None:
        if "Content Security Policy" in msg.text:
            refusals.append(msg.text)

    page.on("console", on_console)
    page.goto(console_stack.server_url + "/api/v1/docs")
    expect(page.locator(".opblock").first).to_be_visible()
    assert page.locator(".opblock").count() > 20  # the whole API, not an error box
    expect(
        page.locator(".opblock-summary-path[data-path='/api/v1/task-groups']").first
    ).to_be_visible()

    # "Try it out" calls the API from the page (connect-src 'self')
    healthz = page.locator(
        ".opblock", has=page.locator(".opblock-summary-path[data-path='/healthz']")
    )
    healthz.locator(".opblock-summary").click()
    healthz.get_by_role("button", name="Try it out").click()
    healthz.get_by_role("button", name="Execute").click()
    answer = healthz.locator(".live-responses-table tr.response")
    expect(answer.locator(".response-col_status")).to_have_text("200")
    expect(answer).to_contain_text('"status": "ok"')

    assert elsewhere == []
    assert page.evaluate("() => window.__csp || []") == []
    assert refusals == []


def test_no_other_page_can_frame_the_api_reference(browser: Browser, console_stack: Stack) -> None:
    ctx = browser.new_context()
    try:
        framer = ctx.new_page()  # about:blank: any other origin
        with framer.expect_console_message(lambda m: "frame-ancestors 'none'" in m.text):
            framer.set_content(f'<iframe src="{console_stack.server_url}/api/v1/docs"></iframe>')
        assert [f.url for f in framer.frames if "/api/v1/docs" in f.url] == []
    finally:
        ctx.close()
