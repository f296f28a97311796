"""How the console's files are served (no browser needed): only the shipped files, with
their content types and security headers, revalidated by ETag; every module the page
loads is there; the package ships them all, the vendored Swagger UI with its licence and
version; and no script parses API text as HTML."""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from heteroflow.api.routes import console, root
from heteroflow.api.security_headers import CSP, SecurityHeadersMiddleware

STATIC = Path(console.__file__).resolve().parents[2] / "console" / "static"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client() -> Iterator[TestClient]:
    app = FastAPI()
    app.add_middleware(SecurityHeadersMiddleware)
    app.include_router(root.router)
    app.include_router(console.router)
    with TestClient(app) as c:
        yield c


def page(client: TestClient) -> str:
    r = client.get("/", headers={"Accept": "text/html"})
    assert r.status_code == 200
    return r.text


def test_assets_come_with_their_type_the_security_headers_and_an_etag(
    client: TestClient,
) -> None:
    for path, ctype in (
        ("js/app.js", "text/javascript"),
        ("console.css", "text/css"),
        ("favicon.svg", "image/svg+xml"),
    ):
        r = client.get(f"/console/{path}")
        assert r.status_code == 200, path
        assert r.headers["content-type"].split(";")[0] == ctype
        assert r.headers["x-content-type-options"] == "nosniff"
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-frame-options"] == "DENY"
        assert r.headers["cache-control"] == "no-cache"
        assert r.content == (STATIC / path).read_bytes()
        again = client.get(f"/console/{path}", headers={"If-None-Match": r.headers["etag"]})
        assert again.status_code == 304 and again.content == b""
        assert client.get(f"/console/{path}", headers={"If-None-Match": '"x"'}).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/console/",
        "/console/js",
        "/console/js/",
        "/console/index.html",  # the page is served at / only, with its headers
        "/console/api-docs.html",  # at /api/v1/docs only
        "/console/api-docs/swagger-ui/LICENSE",  # shipped, but of no served type
        "/console/nope.js",
        "/console/..%2f__init__.py",
        "/console/%2e%2e/__init__.py",
        "/console/js/..%2f..%2f..%2fapi%2froutes%2fconsole.py",
        "/console/%2Fetc%2Fpasswd",
        "/console/JS/APP.JS",
    ],
)
def test_only_the_shipped_files_are_served(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404
    assert r.headers["x-content-type-options"] == "nosniff"


def test_the_page_loads_versioned_entry_points_and_every_module_it_imports_exists(
    client: TestClient,
) -> None:
    html = page(client)
    tag = f"{root.package_version()}-{console.bundle().digest}"
    entries = re.findall(r'(?:src|href)="/console/([^"?]+)\?v=([^"]+)"', html)
    assert ("js/app.js", tag) in entries and ("console.css", tag) in entries
    assert "__HF_" not in html  # every placeholder filled
    # follow the ES module graph from app.js: every relative import answers
    seen: set[str] = set()
    todo = ["js/app.js"]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        r = client.get(f"/console/{path}")
        assert r.status_code == 200, path
        for imported in re.findall(r"from '\./([^']+)';", r.text):
            todo.append(f"js/{imported}")
    shipped = {p.relative_to(STATIC).as_posix() for p in (STATIC / "js").rglob("*.js")}
    assert seen == shipped  # every module is used, none is missing


def test_the_package_data_ships_every_console_file() -> None:
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["heteroflow.console"]
    package = STATIC.parent
    shipped = {p for g in globs for p in package.glob(g)}
    assert shipped == {p for p in STATIC.rglob("*") if p.is_file()}


def test_the_vendored_swagger_ui_says_its_version_and_licence() -> None:
    """static/api-docs/swagger-ui/README.md names the version the bundle is, and the
    Apache-2.0 licence, its NOTICE and the bundle's third-party licences are shipped."""
    vendored = STATIC / "api-docs" / "swagger-ui"
    assert {p.name for p in vendored.iterdir()} == {
        "README.md",
        "LICENSE",
        "NOTICE",
        "swagger-ui-bundle.js",
        "swagger-ui-bundle.js.LICENSE.txt",
        "swagger-ui.css",
    }
    said = re.search(r"Swagger UI \*\*([0-9.]+)\*\*", (vendored / "README.md").read_text())
    bundled = re.search(
        r'PACKAGE_VERSION:"([0-9.]+)"', (vendored / "swagger-ui-bundle.js").read_text()
    )
    assert said and bundled and said.group(1) == bundled.group(1)
    assert "Apache License" in (vendored / "LICENSE").read_text()


def test_no_script_parses_text_as_html() -> None:
    """API values reach the DOM as text nodes or properties only (docs/console.md)."""
    sinks = re.compile(
        r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function"
        r"|createContextualFragment|DOMParser"
    )
    ours = [js for js in STATIC.rglob("*.js") if "swagger-ui" not in js.parts]
    assert len(ours) > 1
    for js in ours:  # Swagger UI's bundle renders the API's description, not API values
        assert not sinks.search(js.read_text()), js.name
