"""The API reference (/api/v1/docs) is served from the package, not a CDN: the page names
no other origin, every file it loads answers from this server with its type, and it
carries the same security headers as the console's pages (docs/security.md "Pages
served to a browser") — as does every other answer of the management API."""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

import pytest

from heteroflow.api.security_headers import CSP
from tests.integration.conftest import Api

BROWSER_ACCEPT = "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8"
# what a page may name: a path on this origin; anything with a scheme or a host is not
OTHER_ORIGIN = re.compile(r"""(?:[a-z][a-z0-9+.-]*:)?//[^\s"'<>]+""", re.IGNORECASE)
TYPES = {".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}


def assert_page_headers(headers: Mapping[str, str]) -> None:
    assert headers["content-security-policy"] == CSP
    directives = CSP.split("; ")
    for d in ("script-src 'self'", "style-src 'self'", "frame-ancestors 'none'"):
        assert d in directives
    assert "unsafe" not in CSP  # no inline script or style, no eval
    assert headers["x-frame-options"] == "DENY"
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "no-referrer"


def test_the_api_reference_loads_only_files_of_this_server(api: Api) -> None:
    r = api.client.get("/api/v1/docs", headers={"Accept": BROWSER_ACCEPT})
    assert r.status_code == 200
    assert r.headers["content-type"] == "text/html; charset=utf-8"
    assert r.headers["cache-control"] == "no-cache"
    assert_page_headers(r.headers)
    page = r.text
    assert OTHER_ORIGIN.findall(page) == []
    assert "__HF_" not in page  # every placeholder filled
    # no inline script: the CSP would refuse it, so Swagger UI starts from a file
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", page, re.DOTALL)
    assert scripts and all("src=" in attrs and not body.strip() for attrs, body in scripts)
    assert "style=" not in page and "<style" not in page

    refs = re.findall(r'(?:src|href|data-openapi)="([^"]+)"', page)
    loaded = [u for u in refs if urlsplit(u).path.endswith((".js", ".css", ".svg"))]
    assert {urlsplit(u).path.rsplit("/", 1)[1] for u in loaded} >= {
        "swagger-ui-bundle.js",
        "swagger-ui.css",
        "init.js",
        "favicon.svg",
    }
    for url in refs:
        parts = urlsplit(url)
        assert not parts.scheme and not parts.netloc and parts.path.startswith("/"), url
        got = api.client.get(url)
        assert got.status_code == 200, url
        suffix = parts.path[parts.path.rfind(".") :]
        want = TYPES.get(suffix, "application/json")  # the OpenAPI description
        assert got.headers["content-type"].split(";")[0] == want, url
        assert got.headers["x-content-type-options"] == "nosniff", url
    # the description the page starts Swagger UI on is this API's
    openapi = api.client.get(re.findall(r'data-openapi="([^"]+)"', page)[0]).json()
    assert "/api/v1/task-groups" in openapi["paths"]


def test_every_page_and_answer_forbids_framing_and_sniffing(api: Api) -> None:
    console_page = api.client.get("/", headers={"Accept": BROWSER_ACCEPT})
    assert console_page.headers["content-type"].startswith("text/html")
    answers = [
        console_page,
        api.client.get("/console/js/app.js"),
        api.client.get("/console/nope.js"),  # 404
        api.client.get("/api/v1/openapi.json"),
        api.client.get("/healthz"),
        api.client.get("/api/v1/task-groups"),  # 401
        api.client.post("/api/v1/auth/login", json={}),  # 422
    ]
    for r in answers:
        assert_page_headers(r.headers)


@pytest.mark.parametrize(
    # FastAPI's own pages (CDN assets, inline scripts) are not served
    "path",
    ["/docs", "/redoc", "/api/v1/redoc", "/docs/oauth2-redirect", "/api/v1/docs/oauth2-redirect"],
)
def test_no_other_docs_page_is_served(api: Api, path: str) -> None:
    r = api.client.get(path, headers={"Accept": BROWSER_ACCEPT})
    assert r.status_code == 404
    assert_page_headers(r.headers)
