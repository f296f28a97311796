"""A copy of a model from another node's agent (issue 29 item 4; the agent's side of
``agent.peer_server``).

- ``peer_manifest``: ask a holder for its copy's manifest (``fleet://`` sources: the
  holder's word is all there is — files, sizes, and the SHA-256 its source gave);
- ``via_peer``: an origin's manifest with each file fetched from a holder instead — the
  sizes and checksums stay the origin's, so a copy is checked against the source itself.

Both give a ``Manifest`` with ``copied_from`` set (no unpacking: a holder's files are the
model as it lies) whose files point at the holder's file route; every request is signed
with the node token by a ``Signer`` (``node_signer``), never sent in it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from urllib.parse import quote

import aiohttp
from yarl import URL

from heteroflow.core.errors import ValidationFailed
from heteroflow.core.model_sources import FIELD, parse_model_source
from heteroflow.core.node_signature import sign
from heteroflow.models.fetch.http import Signer, request, status_failure
from heteroflow.models.fetch.manifest import Manifest, ManifestFile, SourceFailed
from heteroflow.schemas.nodes import PeerCopy

__all__ = ["file_url", "node_signer", "peer_manifest", "via_peer"]

MAX_MANIFEST_BYTES = 8 << 20


def node_signer(node: str, token: str, now_s: Callable[[], float]) -> Signer:
    def signed(method: str, url: str) -> str:
        return sign(token, method, URL(url).raw_path_qs, node, now_s())
    return signed


def file_url(peer: PeerCopy, path: str) -> str:
    return f"{peer.url}/v1/models/{peer.key}/files/{quote(path)}"


def via_peer(manifest: Manifest, peer: PeerCopy) -> Manifest:
    """``manifest`` (the origin's) fetched from ``peer`` instead."""
    return Manifest(
        source=manifest.source, revision=manifest.revision, copied_from=peer.node,
        files=tuple(ManifestFile(f.path, f.size, f.sha256, file_url(peer, f.path))
                    for f in manifest.files),
    )


async def peer_manifest(
    session: aiohttp.ClientSession, peer: PeerCopy, signer: Signer,
    timeout: aiohttp.ClientTimeout,
) -> Manifest:
    """The manifest of ``peer``'s copy, or ``SourceFailed`` (unreachable, not found,
    unauthorized: the node tokens differ, invalid: the answer is not a manifest of that
    key)."""
    url = f"{peer.url}/v1/models/{peer.key}"
    what = f"the copy {peer.key} on node {peer.node}"
    async with request(session, "GET", url, timeout=timeout, signer=signer) as resp:
        if resp.status != 200:
            raise status_failure(resp.status, url, what)
        body = await resp.content.read(MAX_MANIFEST_BYTES + 1)
    try:
        if len(body) > MAX_MANIFEST_BYTES:
            raise ValueError("too large")
        data = json.loads(body)
        manifest = Manifest(
            source=parse_model_source(str(data["source"])),
            revision=str(data.get("revision") or ""),
            copied_from=peer.node,
            files=tuple(
                ManifestFile(str(f["path"]), int(f["size"]), f.get("sha256"),
                             file_url(peer, str(f["path"])))
                for f in data["files"]
            ),
        )
    except (ValueError, KeyError, TypeError, ValidationFailed) as e:
        raise SourceFailed("invalid", f"{FIELD}: {what} answered no manifest "
                           f"({type(e).__name__})") from None
    if manifest.cache_key != peer.key:
        raise SourceFailed("invalid", f"{FIELD}: {what} describes another model "
                           f"({manifest.cache_key})")
    return manifest
