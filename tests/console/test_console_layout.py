"""The console at a laptop's and a phone's width, by keyboard, in the dark (issue 33, "What
to build" 4), and a service's replica range edited from its page (issue 33's first week:
the console offered no way to change it).

Every page is opened at 1366 by 768 and at 390 by 844 pixels: the page never scrolls
sideways (a wide table scrolls in its own box), Tab from the top of the page reaches the
page's primary action and shows where the focus is, a dialog closes with Escape, and under
an emulated ``prefers-color-scheme: dark`` the page is drawn dark. With
``HETEROFLOW_SCREENSHOTS=1`` each page is saved at both widths into
docs/console/<page>-<width>.png (the window only, so the files stay small).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import expect

from tests.console.conftest import SHOTS_DIR, Console
from tests.e2e.conftest import ADMIN_PASSWORD, Stack

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Locator, Page, ViewportSize

pytestmark = pytest.mark.e2e

LAPTOP: ViewportSize = {"width": 1366, "height": 768}
PHONE: ViewportSize = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def one_click(console_stack: Stack) -> Iterator[dict[str, Any]]:
    """A service made as the console's Deploy makes one (no image: one-click, ``split``)."""
    st = console_stack
    r = st.api(
        "POST",
        "/api/v1/task-groups",
        json={
            "name": "layout",
            "model_name": "layout-model",
            "health_check": {"interval_seconds": 0.5, "start_period_seconds": 30},
            "task": {
                "model_path": str(st.model_file),
                "gpu_required": 0,
                "memory_mb": 512,
                "engine_args": ["-c", "1024"],
            },
        },
    )
    assert r.status_code == 201, r.text
    g = dict(r.json())
    assert g["parallelism"] == "split"  # what one-click makes: N copies, here one
    st.wait_status(g["id"], "running")
    yield g
    st.api("DELETE", f"/api/v1/task-groups/{g['id']}")


def tab(browser: Browser, st: Stack, viewport: ViewportSize, **ctx: Any) -> Console:
    """A fresh tab at ``viewport``, logged in as admin."""
    page = browser.new_context(viewport=viewport, **ctx).new_page()
    page.set_default_timeout(30_000)  # a loaded 2-core machine
    c = Console(page, st.server_url)
    page.on("pageerror", lambda exc: c.errors.append(f"page error: {exc}"))
    try:
        c.login("admin", ADMIN_PASSWORD)
    except Exception:
        page.context.close()
        raise AssertionError(f"login failed; the page's errors: {c.errors}") from None
    return c


def overflow(page: Page) -> int:
    """How many pixels the page is wider than the window (0: no sideways scroll)."""
    return int(
        page.evaluate(
            "() => document.documentElement.scrollWidth - document.documentElement.clientWidth"
        )
    )


def too_wide(page: Page) -> list[str]:
    """The outermost elements that reach past the window's right edge and are not inside
    a box that scrolls or clips them (for the failure's message)."""
    return list(
        page.evaluate("""() => {
        const w = document.documentElement.clientWidth, out = [];
        const past = (el) => el.getBoundingClientRect().right > w + 1;
        const clipped = (el) => {
          for (let a = el.parentElement; a && a !== document.body; a = a.parentElement) {
            if (getComputedStyle(a).overflowX !== 'visible') return true;
          }
          return false;
        };
        for (const el of document.querySelectorAll('body *')) {
          if (past(el) && !(el.parentElement && past(el.parentElement)) && !clipped(el)) {
            const right = Math.round(el.getBoundingClientRect().right);
            out.push(`${el.tagName.toLowerCase()}.${el.className} right=${right}`);
          }
        }
        return out.slice(0, 8);
    }""")
    )


def tab_to(page: Page, target: Locator, presses: int = 80) -> int:
    """Press Tab from the top of the page until ``target`` has the focus; the presses it
    took. Fails when it never does, or when the focus is not drawn."""
    handle = target.element_handle()
    assert handle is not None
    page.evaluate(
        "() => { document.activeElement && document.activeElement.blur(); window.scrollTo(0, 0); }"
    )
    page.locator("body").focus()
    for n in range(1, presses + 1):
        page.keyboard.press("Tab")
        if page.evaluate("(el) => document.activeElement === el", handle):
            outline = page.evaluate(
                "(el) => [getComputedStyle(el).outlineStyle, getComputedStyle(el).outlineWidth]",
                handle,
            )
            assert outline[0] != "none" and outline[1] != "0px", f"focus not drawn: {outline}"
            return n
    raise AssertionError(f"Tab never reached {target} in {presses} presses")


# page, route, its primary action (what Tab must reach)
def pages(group_id: str) -> list[tuple[str, str, Any]]:
    return [
        ("services", "#/services", lambda p: p.get_by_role("button", name="New service")),
        (
            "service-detail",
            f"#/services/{group_id}",
            lambda p: p.get_by_role("button", name="Replica range…"),
        ),
        ("models", "#/models", lambda p: p.get_by_role("button", name="Deploy tiny from e2e-node")),
        ("nodes", "#/nodes", None),  # a CPU node: nothing to act on, only to read
        ("fleet", "#/fleet", None),  # charts and tables to read, no action
        ("usage", "#/usage", lambda p: p.get_by_role("button", name="Export CSV")),
        ("control-panel", "#/admin", lambda p: p.get_by_role("button", name="Create tenant")),
    ]


@pytest.mark.feature("O1", "O3")
@pytest.mark.parametrize("viewport", [LAPTOP, PHONE], ids=["1366", "390"])
def test_every_page_fits_the_width_and_tab_reaches_its_action(
    browser: Browser, console_stack: Stack, one_click: dict[str, Any], viewport: ViewportSize
) -> None:
    # the login form, before anyone is logged in
    login = browser.new_context(viewport=viewport).new_page()
    try:
        login.goto(console_stack.server_url + "/")
        button = login.get_by_role("button", name="Log in")
        expect(button).to_be_visible(timeout=30_000)
        assert overflow(login) <= 0, ("login", viewport["width"], too_wide(login))
        tab_to(login, button)
    finally:
        login.context.close()
    c = tab(browser, console_stack, viewport)
    page = c.page
    try:
        for name, route, action in pages(one_click["id"]):
            c.goto(route)
            target = action(page) if action else page.locator("main h1")
            expect(target.first).to_be_visible()
            assert overflow(page) <= 0, (name, viewport["width"], too_wide(page))
            if os.environ.get("HETEROFLOW_SCREENSHOTS") == "1":
                page.evaluate("() => document.querySelectorAll('.toast').forEach(t => t.remove())")
                page.screenshot(path=str(SHOTS_DIR / f"{name}-{viewport['width']}.png"))
            if action:
                tab_to(page, target.first)
        # a dialog closes with Escape, and gives the focus back to the page
        c.goto("#/services")
        page.get_by_role("button", name="New service").click()
        expect(page.locator("dialog.modal")).to_be_visible()
        assert overflow(page) <= 0
        page.keyboard.press("Escape")
        expect(page.locator("dialog.modal")).to_have_count(0)
        assert c.errors == [], c.errors
    finally:
        page.context.close()


@pytest.mark.feature("O1")
def test_the_dark_theme_follows_the_system_setting(
    browser: Browser, console_stack: Stack, one_click: dict[str, Any]
) -> None:
    def luminance(page: Page, selector: str) -> float:
        rgb = page.evaluate(
            "(s) => getComputedStyle(document.querySelector(s)).backgroundColor", selector
        )
        r, g, b = (int(x) for x in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3])
        return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255

    seen = {}
    for scheme in ("light", "dark"):
        c = tab(browser, console_stack, LAPTOP, color_scheme=scheme)
        try:
            c.goto("#/services")
            expect(c.page.locator(f'article[data-id="{one_click["id"]}"]')).to_be_visible()
            seen[scheme] = (luminance(c.page, "html"), luminance(c.page, "article.card"))
            if scheme == "dark" and os.environ.get("HETEROFLOW_SCREENSHOTS") == "1":
                c.page.screenshot(path=str(SHOTS_DIR / "services-dark.png"))
        finally:
            c.page.context.close()
    assert seen["light"][0] > 0.8 and seen["light"][1] > 0.8, seen
    assert seen["dark"][0] < 0.2 and seen["dark"][1] < 0.2, seen


@pytest.mark.feature("I1", "O3")
def test_the_replica_range_is_edited_from_the_service_page(
    console: Console, console_stack: Stack, one_click: dict[str, Any]
) -> None:
    st, page, gid = console_stack, console.page, one_click["id"]
    console.login("admin")
    card = page.locator(f'article[data-id="{gid}"]')
    # split is N copies of the model: one copy is shown as what it is, a single replica
    expect(card.locator('dd[data-fact="parallelism"]')).to_have_text("single")
    expect(card.locator('dd[data-fact="replicas"]')).to_have_text("min 1 · now 1 · max 1")

    console.goto(f"#/services/{gid}")
    page.get_by_role("button", name="Replica range…").click()
    dialog = page.locator("dialog.modal")
    dialog.get_by_label("Max replicas").fill("3")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog).to_have_count(0)
    g = st.group(gid)
    assert (g["min_replicas"], g["max_replicas"]) == (1, 3), g
    assert not (g.get("scale_policy") or {}).get("enabled"), g["scale_policy"]
    console.goto("#/services")
    expect(card.locator('dd[data-fact="replicas"]')).to_have_text("min 1 · now 1 · max 3")

    # turning autoscaling on without a target: the API's 400 names the field in the dialog
    console.goto(f"#/services/{gid}")
    page.get_by_role("button", name="Replica range…").click()
    dialog.get_by_label("Autoscaling").check()
    dialog.get_by_label("Target per replica").fill("")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog.locator(".form-error")).to_contain_text("target")
    dialog.get_by_label("Target per replica").fill("4")
    dialog.get_by_role("button", name="Save").click()
    expect(dialog).to_have_count(0)
    p = st.group(gid)["scale_policy"]
    assert (p["enabled"], p["metric"], p["target"]) == (True, "inflight", 4), p

    # with autoscaling on, Scale outside its range is refused with what to do, not moved
    scale = page.get_by_role("spinbutton", name="Replicas", exact=True)
    scale.fill("5")
    page.get_by_role("button", name="Scale", exact=True).click()
    expect(page.locator(".toast.level-error")).to_contain_text("outside the autoscaling range 1-3")
    assert st.group(gid)["max_replicas"] == 3
    # back as it was, for the other tests of this module
    r = st.api(
        "PUT",
        f"/api/v1/task-groups/{gid}/scale-policy",
        json={"enabled": False, "min_replicas": 1, "max_replicas": 1},
    )
    assert r.status_code == 200, r.text
