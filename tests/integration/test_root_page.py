"""GET / says what this server is: the web console for a browser, JSON for anything else."""

from __future__ import annotations

import re
from importlib.metadata import version

from tests.integration.conftest import Api

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


def test_a_browser_gets_the_console_with_the_ways_in(api: Api) -> None:
    r = api.client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert r.headers["cache-control"] == "no-cache"  # a new release's page at once
    assert r.headers["vary"] == "Accept"
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
    page = r.text
    assert "HeteroFlow" in page and version("heteroflow") in page
    # the console's script and style, their URLs versioned with the release
    assets = re.findall(r'(?:src|href)="(/console/[^"]+)"', page)
    assert f"/console/js/app.js?v={version('heteroflow')}-" in " ".join(assets)
    links = set(re.findall(r'href="(/[^"]+)"', page)) - set(assets)
    assert {"/api/v1/docs", "/metrics", "/healthz"} <= links
    assert 'id="openai-base"' in page  # the OpenAI base URL (the page writes its origin)
    assert "docs/" in page  # where the guides are
    # every link and asset on the page answers
    statuses = {link: api.client.get(link).status_code for link in links | set(assets)}
    assert statuses == dict.fromkeys(links | set(assets), 200)


def test_other_clients_get_json(api: Api) -> None:
    for accept in (None, "*/*", "application/json"):
        headers = {"Accept": accept} if accept else {}
        r = api.client.get("/", headers=headers)
        assert r.status_code == 200
        assert r.headers["content-type"] == "application/json"
        assert r.json() == {
            "name": "heteroflow",
            "version": version("heteroflow"),
            "api": "/api/v1",
            "openai": "/v1",
            "docs": "/api/v1/docs",
        }
    assert api.client.get("/api/v1/openapi.json").json()["info"]["version"] == version("heteroflow")
