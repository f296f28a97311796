"""GET /: what this server is and where to go from here.

A browser (``Accept: text/html``) gets the web console's page (api/routes/console.py,
docs/console.md); any other client a JSON object ``{"name", "version", "api", "openai",
"docs"}`` with the pointers: the management API prefix, the OpenAI-compatible base URL
and the interactive API reference. Nothing here needs a login or says anything about
the fleet (the console logs in through the API like any client).

The API reference (``GET /api/v1/docs``) is Swagger UI shipped in the package
(console/static/api-docs), not FastAPI's page: that one loads Swagger UI from a public
CDN and starts it with an inline script, so it is blank offline and needs a weaker CSP.
"""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from heteroflow.api.routes import console
from heteroflow.api.unit_of_work import api_router

NAME = "heteroflow"
API_PREFIX = "/api/v1"
OPENAI_BASE = "/v1"
API_DOCS = "/api/v1/docs"
METRICS = "/metrics"

router = api_router(tags=["health"])


@cache
def package_version() -> str:
    """The installed package's version ("" when running from a bare source tree)."""
    try:
        return version(NAME)
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return ""


def _wants_html(accept: str) -> bool:
    """A browser's Accept lists text/html; curl (``*/*``) and API clients get JSON."""
    return any(
        part.split(";", 1)[0].strip().lower() in ("text/html", "application/xhtml+xml")
        for part in accept.split(",")
    )


@router.get("/", include_in_schema=False)
def root(request: Request) -> Response:
    ver = package_version()
    if _wants_html(request.headers.get("accept", "")):
        return console.index_response(ver)
    return JSONResponse(
        {"name": NAME, "version": ver, "api": API_PREFIX, "openai": OPENAI_BASE, "docs": API_DOCS},
        headers={"Vary": "Accept"},  # the same URL answers the console's page to a browser
    )


@router.get(API_DOCS, include_in_schema=False)
def api_docs() -> Response:
    return console.page_response(console.API_DOCS, package_version())
