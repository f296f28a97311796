"""GET / says what this server is: an HTML page for a browser, JSON for anything else."""

from __future__ import annotations

import re
from importlib.metadata import version

from tests.integration.conftest import Api

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"


def test_a_browser_gets_a_page_with_the_ways_in(api: Api) -> None:
    r = api.client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    page = r.text
    assert "HeteroFlow" in page and version("heteroflow") in page
    links = set(re.findall(r'href="([^"]+)"', page))
    assert {"/api/v1/docs", "/metrics", "/v1/models"} <= links
    assert "http://testserver/v1" in page  # the OpenAI base URL as this client reaches it
    assert "docs/" in page  # where the guides are
    # every link on the page answers (the model list asks for a key: 401, not 404)
    statuses = {link: api.client.get(link).status_code for link in links}
    assert statuses == {link: 401 if link == "/v1/models" else 200 for link in links}


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
