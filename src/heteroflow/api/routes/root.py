"""GET /: what this server is and where to go from here.

A browser (``Accept: text/html``) gets a small HTML page; any other client a JSON object
``{"name", "version", "api", "openai", "docs"}`` with the same pointers: the management
API prefix, the OpenAI-compatible base URL and the interactive API reference. Nothing
here needs a login or says anything about the fleet.
"""

from __future__ import annotations

from functools import cache
from html import escape
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

NAME = "heteroflow"
API_PREFIX = "/api/v1"
OPENAI_BASE = "/v1"
API_DOCS = "/api/v1/docs"
METRICS = "/metrics"

router = APIRouter(tags=["health"])


@cache
def package_version() -> str:
    """The installed package's version ("" when running from a bare source tree)."""
    try:
        return version(NAME)
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return ""


def _page(ver: str, base: str) -> str:
    v = escape(ver)
    b = escape(base)
    return f"""<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>HeteroFlow {v}</title></head>
<body>
<h1>HeteroFlow {v}</h1>
<p>Serves large language models on a pool of mixed GPU nodes behind an
OpenAI-compatible gateway. This server answers the management API and the gateway.</p>
<ul>
<li><a href="{API_DOCS}">{API_DOCS}</a> &mdash; the management API reference (try it here;
log in with <code>POST {API_PREFIX}/auth/login</code>)</li>
<li><code>{b}{OPENAI_BASE}</code> &mdash; the OpenAI-compatible base URL: point the OpenAI SDK
there with a service's API key (<code>{OPENAI_BASE}/chat/completions</code>,
<code>{OPENAI_BASE}/completions</code>, <code>{OPENAI_BASE}/embeddings</code>,
<a href="{OPENAI_BASE}/models"><code>{OPENAI_BASE}/models</code></a>)</li>
<li><a href="{METRICS}">{METRICS}</a> &mdash; the gateway's Prometheus metrics</li>
<li><a href="/healthz">/healthz</a> &mdash; liveness</li>
</ul>
<p>The guides (concepts, API, operations, engines, security) are in <code>README.md</code>
and <code>docs/</code> of the HeteroFlow source tree.</p>
</body>
</html>
"""


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
        return HTMLResponse(_page(ver, str(request.base_url).rstrip("/")))
    return JSONResponse(
        {"name": NAME, "version": ver, "api": API_PREFIX, "openai": OPENAI_BASE, "docs": API_DOCS}
    )
