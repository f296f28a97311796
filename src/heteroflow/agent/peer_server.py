"""The node's model cache, served to the other agents of the fleet (issue 29 item 4).

A node that needs a model this node holds copies it from here instead of from the
source's origin (``agent.fetching``). Two routes, read-only, complete models only:

- ``GET /v1/models/{key}``: the copy's manifest — its source, revision and files as they
  lie (relative path, size, and the SHA-256 the source gave where the file is the one
  it named);
- ``GET /v1/models/{key}/files/{path}``: one of those files, ranges honoured (a cut copy
  resumes as a download does).

Every request is signed with the node token (``core.node_signature``; 401 otherwise),
and a node with no token serves nothing. A path must be one the listing names: never a
symlink, the marker, a download in progress or anything outside the model's folder. A
file being sent pins its model (never evicted mid-copy). TLS when the operator gives a
certificate (``peer_tls_cert``/``peer_tls_key``): the copying agent verifies it against
its ``ca_file``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from heteroflow.core.model_sources import CACHE_KEY
from heteroflow.core.node_signature import BadSignature, verify
from heteroflow.models.fetch.manifest import safe_relative

if TYPE_CHECKING:
    from heteroflow.agent.state import AgentState

log = logging.getLogger(__name__)

__all__ = ["peer_app", "serve_peers"]


def _signed(agent: AgentState) -> Callable[[web.Request], Awaitable[str]]:
    async def check(request: web.Request) -> str:
        try:
            return verify(
                request.headers.get("Authorization", ""),
                agent.settings.node_token, request.method, request.raw_path,
                agent.clock.now().timestamp(),
            )
        except BadSignature as e:
            raise web.HTTPUnauthorized(text=f"not a signed request of this fleet: {e}") from None
    return check


def _key(request: web.Request) -> str:
    key = request.match_info["key"]
    if not CACHE_KEY.match(key):
        raise web.HTTPNotFound(text="no such model")
    return key


def peer_app(agent: AgentState) -> web.Application:
    signed = _signed(agent)

    async def manifest(request: web.Request) -> web.Response:
        peer = await signed(request)
        key = _key(request)
        cache = agent.model_cache
        held = cache.manifest_of(key)
        if held is None:
            raise web.HTTPNotFound(text=f"this node holds no complete model {key}")
        named = {f.path: f for f in held.files}
        files = []
        for path, size in await asyncio.to_thread(cache.files_of, key):
            f = named.get(path)
            sha = f.sha256 if f is not None and f.size in (None, size) else None
            files.append({"path": path, "size": size, "sha256": sha})
        log.info("peer %s asked for the manifest of %s", peer, key)
        return web.json_response({
            "key": key, "source": held.source.text, "revision": held.revision,
            "files": files,
        })

    async def file(request: web.Request) -> web.StreamResponse:
        await signed(request)
        key = _key(request)
        rel = safe_relative(request.match_info["path"])
        cache = agent.model_cache
        if rel is None or not cache.is_complete(key):
            raise web.HTTPNotFound(text="no such file")
        listed = dict(await asyncio.to_thread(cache.files_of, key))
        if rel not in listed:
            raise web.HTTPNotFound(text="no such file")
        cache.acquire(key)  # a copy in progress is a use: never evicted under it
        try:
            response = web.FileResponse(Path(cache.path_of(key)) / rel)
            await response.prepare(request)
            await response.write_eof()
            return response
        finally:
            cache.release(key)

    app = web.Application()
    app.router.add_get("/v1/models/{key}", manifest)
    app.router.add_get("/v1/models/{key}/files/{path:.+}", file)
    return app


async def serve_peers(
    agent: AgentState,
    stop: asyncio.Event,
    bound: Callable[[str], None],
) -> None:
    """Serve the cache on ``peer_port`` until ``stop``; ``bound`` gets the URL the other
    agents use (the node's address). Not served without a node token (nothing could be
    checked) or when the port cannot be bound (logged: the node copies still work from
    the origins)."""
    settings = agent.settings
    if settings.peer_port is None:
        return
    if not settings.node_token:
        log.warning("model copies are not served to other nodes: this agent has no node "
                     "token to check their signatures with")
        return
    tls: ssl.SSLContext | None = None
    if settings.peer_tls_cert is not None and settings.peer_tls_key is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(settings.peer_tls_cert, settings.peer_tls_key)
    host = settings.peer_host or settings.address
    runner = web.AppRunner(peer_app(agent), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, settings.peer_port, ssl_context=tls)
        try:
            await site.start()
        except OSError as exc:
            log.error("model copies not served on %s:%d: %s", host, settings.peer_port,
                      exc.strerror or exc)
            return
        port = int(runner.addresses[0][1])
        shown = f"[{settings.address}]" if ":" in settings.address else settings.address
        url = f"{'https' if tls else 'http'}://{shown}:{port}"
        log.info("model copies served to other nodes on %s", url)
        bound(url)
        await stop.wait()
    finally:
        await runner.cleanup()
