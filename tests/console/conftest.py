"""Browser tests of the web console (issue 17): Playwright for Python driving Debian's
Chromium (``/usr/bin/chromium``; a Playwright browser download does not work here) against
a real server, agent and gateway serving the tiny model (tests/e2e's ``launch_stack``).

Without Chromium or the playwright package the tests skip, saying why — unless
``HETEROFLOW_REQUIRE_BROWSER=1`` (CI sets it), where they fail instead. With
``HETEROFLOW_SCREENSHOTS=1`` the tests save a PNG of each page into docs/console/.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.e2e.conftest import ADMIN_PASSWORD, Stack, launch_stack

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Page, ViewportSize

CHROMIUM = Path("/usr/bin/chromium")
# ../shared/ENVIRONMENT.md "Browser tests": headless, no sandbox (root), nothing fetched
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
    "--disable-sync",
]
SHOTS_DIR = Path(__file__).resolve().parents[2] / "docs" / "console"
# a laptop screen: what the console is laid out for
VIEWPORT: ViewportSize = {"width": 1366, "height": 768}


def missing_browser() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not CHROMIUM.exists():
        return (
            f"{CHROMIUM} is missing (apt-get install chromium; scripts/test installs it "
            "when run as root)"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the playwright package is missing (pip install -e '.[test]')"
    return None


# Package scope, not session: Playwright's sync API keeps an event loop running in this
# thread while it lives, and every later test that calls asyncio.run() would fail.
@pytest.fixture(scope="package")
def browser() -> Iterator[Browser]:
    why = missing_browser()
    if why is not None:
        if os.environ.get("HETEROFLOW_REQUIRE_BROWSER") == "1":
            pytest.fail(f"HETEROFLOW_REQUIRE_BROWSER=1 but {why}")
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="package")
def console_stack(browser: Browser, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """One real stack for the console's tests (started only when a browser is there)."""
    with launch_stack(
        tmp_path_factory.mktemp("console"),
        node_name="e2e-node",
        server_env={
            "HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "0.5",  # the usage page shows the calls soon
            "HETEROFLOW_ROLLOUT_INTERVAL_S": "0.25",  # a failing update fails in seconds
            "HETEROFLOW_ROLLOUT_BATCH_RETRIES": "1",
        },
        agent_env={
            "HETEROFLOW_AGENT_LOG_SHIP_INTERVAL_S": "0.5",
            "HETEROFLOW_AGENT_PORT_RETRY_TOTAL_S": "6",
        },
    ) as st:
        yield st


@dataclass
class Console:
    """One browser tab on the console, and what went wrong in it."""

    page: Page
    base: str
    errors: list[str] = field(default_factory=list)

    def goto(self, route: str) -> None:
        """Open a page (``#/models``) and wait until it has shown the API's answer."""
        self.page.goto(f"{self.base}/{route}")
        self.page.wait_for_selector("main[data-loaded=true]", timeout=15_000)

    def login(self, username: str, password: str = ADMIN_PASSWORD) -> None:
        self.page.goto(self.base + "/")
        self.page.get_by_label("User name").fill(username)
        self.page.get_by_label("Password").fill(password)
        self.page.get_by_role("button", name="Log in").click()
        self.page.wait_for_selector("main[data-loaded=true]", timeout=15_000)

    def logout(self) -> None:
        self.page.get_by_role("button", name="Log out").click()
        self.page.get_by_role("button", name="Log in").wait_for()

    def shot(self, name: str, height: int = 0) -> None:
        """docs/console/<name>.png (the whole page, without passing toasts), when
        HETEROFLOW_SCREENSHOTS=1; ``height``: a taller window for the shot (a dialog)."""
        if os.environ.get("HETEROFLOW_SCREENSHOTS") != "1":
            return
        SHOTS_DIR.mkdir(parents=True, exist_ok=True)
        self.page.evaluate("() => document.querySelectorAll('.toast').forEach(t => t.remove())")
        if height:
            self.page.set_viewport_size({"width": VIEWPORT["width"], "height": height})
        try:
            self.page.screenshot(path=str(SHOTS_DIR / f"{name}.png"), full_page=True)
        finally:
            self.page.set_viewport_size(VIEWPORT)


@pytest.fixture
def console(browser: Browser, console_stack: Stack) -> Iterator[Console]:
    """A fresh tab (own session storage) at laptop size; fails the test on any script
    error or console error the page reported."""
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport=VIEWPORT)
    page = ctx.new_page()
    page.set_default_timeout(20_000)
    expect.set_options(timeout=15_000)  # a loaded 2-core machine: pages refresh every 2-3 s
    c = Console(page, console_stack.server_url)
    page.on("pageerror", lambda exc: c.errors.append(f"page error: {exc}"))

    def on_console(msg: ConsoleMessage) -> None:
        # an API answer of 4xx is the browser's "Failed to load resource" line: expected
        # where a test asks for what it may not see; the page shows the API's message
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            c.errors.append(f"console {msg.type}: {msg.text}")

    page.on("console", on_console)
    try:
        yield c
    finally:
        ctx.close()
    assert c.errors == [], c.errors


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    rep = outcome.get_result()
    st = item.funcargs.get("console_stack") if hasattr(item, "funcargs") else None
    if rep.failed and isinstance(st, Stack):
        rep.sections.append(("process logs", st.logs()))
