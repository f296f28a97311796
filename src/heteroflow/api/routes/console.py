"""The web console's files: its page (``GET /`` for a browser, see root.py) and
``GET /console/{path}`` for its assets (docs/console.md).

Only the files shipped in ``heteroflow/console/static`` are served. They are read once
into a table keyed by their path relative to that folder, and a request is looked up in
it: anything that is not a key (``..``, an absolute path, an encoded slash, a file added
later, a folder) is a 404 without the file system being asked. The pages (``*.html``: the
console's, and the API reference's at /api/v1/docs, Swagger UI shipped in
``static/api-docs``) are served by their routes only, never as files. Every answer gets
the security headers from api/security_headers.py (a strict Content-Security-Policy: the
pages load scripts, styles and data from this origin only, no inline script or style, no
framing). A page is never cached; the assets are revalidated by their ETag on every load
(the ES modules import one another by relative URL, which carries no version), and the
pages' asset URLs carry ``?v=<version>-<content hash>`` so a new release is fetched at once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cache
from html import escape
from importlib.resources import files
from importlib.resources.abc import Traversable
from urllib.parse import quote

from fastapi import Request
from fastapi.responses import Response

from heteroflow.api.unit_of_work import api_router

CONTENT_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
INDEX = "index.html"  # the console
API_DOCS = "api-docs.html"  # the API reference (Swagger UI)

router = api_router(include_in_schema=False)


@dataclass(frozen=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


@dataclass(frozen=True)
class Bundle:
    pages: dict[str, str]  # *.html as shipped, with their placeholders
    assets: dict[str, Asset]  # relative path -> file
    digest: str  # over every file: changes whenever one does


def _walk(node: Traversable, prefix: str = "") -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        if child.is_dir():
            out += _walk(child, f"{prefix}{child.name}/")
        elif child.is_file():
            out.append((f"{prefix}{child.name}", child.read_bytes()))
    return out


def _etag(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:24] + '"'


@cache
def bundle() -> Bundle:
    """The shipped files, read once (a file of a type not in CONTENT_TYPES is not served)."""
    shipped = _walk(files("heteroflow.console") / "static")
    digest = hashlib.sha256()
    for name, body in shipped:
        digest.update(name.encode() + b"\0" + hashlib.sha256(body).digest())
    table = dict(shipped)
    assets = {
        name: Asset(body, CONTENT_TYPES[suffix], _etag(body))
        for name, body in table.items()
        if (suffix := name[name.rfind(".") :]) in CONTENT_TYPES
    }
    pages = {name: body.decode() for name, body in table.items() if name.endswith(".html")}
    return Bundle(pages, assets, digest.hexdigest()[:12])


def page_response(name: str, version: str, headers: dict[str, str] | None = None) -> Response:
    """A shipped page (``INDEX``, ``API_DOCS``): its asset URLs versioned, never cached."""
    b = bundle()
    tag = f"{version or 'dev'}-{b.digest}"
    page = (
        b.pages[name]
        .replace("__HF_TAG__", quote(tag, safe=""))
        .replace("__HF_VERSION__", escape(version or "dev"))
    )
    return Response(
        page,
        media_type="text/html; charset=utf-8",
        headers={"Cache-Control": "no-cache", **(headers or {})},
    )


def index_response(version: str) -> Response:
    """The console's page (``Vary: Accept``: the same URL answers JSON to API clients)."""
    return page_response(INDEX, version, {"Vary": "Accept"})


@router.get("/console/{path:path}")
def asset(path: str, request: Request) -> Response:
    a = bundle().assets.get(path)
    if a is None:
        return Response("not found", status_code=404, media_type="text/plain")
    headers = {"Cache-Control": "no-cache", "ETag": a.etag}
    if a.etag in (t.strip() for t in request.headers.get("if-none-match", "").split(",")):
        return Response(status_code=304, headers=headers)
    return Response(a.body, media_type=a.content_type, headers=headers)
