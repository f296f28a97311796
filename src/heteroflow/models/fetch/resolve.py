"""The real resolver: a model source → its ``Manifest``, by asking the source.

- Hugging Face: ``GET {endpoint}/api/models/{org/name}/revision/{rev}?blobs=true`` (what
  ``huggingface_hub``'s ``HfApi.model_info(files_metadata=True)`` asks): ``sha`` is the
  resolved commit, each of ``siblings`` gives ``rfilename``, ``size`` and, for a file
  in LFS, ``lfs.sha256``. Files are fetched from ``{endpoint}/{org/name}/resolve/{commit}/
  {path}`` (``hf_hub_url``'s form), pinned to the commit so a branch that moves while a
  node downloads cannot mix two revisions. A non-LFS file (a config, a tokenizer) has a
  git blob id, not a SHA-256: it is checked by size.
- ModelScope: ``GET {endpoint}/api/v1/models/{org/name}/repo/files?Revision={rev}&
  Recursive=true`` (what the ``modelscope`` SDK's ``HubApi.get_model_files`` asks):
  ``Data.Files[]`` with ``Type`` ``blob``, ``Path``, ``Size``, ``Sha256``; files from
  ``{endpoint}/api/v1/models/{org/name}/repo?Revision={rev}&FilePath={path}``. The
  listing names no repository commit, so the resolved revision is the one asked for.
  Checked against the SDK's source, not against the real service (unreachable here).
- https: ``HEAD`` gives the size (``Content-Length``; a server that answers no ``HEAD``
  is asked for byte 0 and its ``Content-Range`` total); the SHA-256 is a hub's
  ``X-Linked-Etag`` (a ``…/resolve/…`` URL of a file in LFS: on its redirect to the CDN),
  else a ``{url}.sha256`` sidecar when the server has one (its first word, as
  ``sha256sum`` writes it).
- fleet: no origin to ask (``unsupported``): a node copies it from a holder's agent
  (``agent.fetch_plan``, ``models.fetch.peer``).

The endpoints are the operator's (a mirror) and the timeout is the caller's: constructor
arguments. A token goes to the endpoint only: as ``Authorization: Bearer`` to Hugging Face
and a web server, as the ``m_session_id`` cookie to ModelScope (``http.token_form``).
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import aiohttp

from heteroflow.core.model_sources import FIELD, ModelSource, SourceKind
from heteroflow.models.fetch.http import TokenForm, request, shown, status_failure
from heteroflow.models.fetch.manifest import (
    Manifest,
    ManifestFile,
    SourceFailed,
    safe_relative,
)

HF_ENDPOINT = "https://huggingface.co"
MODELSCOPE_ENDPOINT = "https://www.modelscope.cn"
MAX_LISTING_BYTES = 32 << 20
_SHA256_WORD = re.compile(r"^([0-9a-fA-F]{64})(\s|$)")


class SourceResolver:
    def __init__(
        self,
        *,
        hf_endpoint: str = HF_ENDPOINT,
        modelscope_endpoint: str = MODELSCOPE_ENDPOINT,
        timeout_s: float = 30.0,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        self.hf_endpoint = hf_endpoint.rstrip("/")
        self.modelscope_endpoint = modelscope_endpoint.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session

    async def resolve(self, source: ModelSource, token: str | None = None) -> Manifest:
        if source.kind is SourceKind.PATH:
            raise SourceFailed("unsupported", f"{FIELD}: a path is read on the node, "
                               "not resolved")
        if source.kind is SourceKind.FLEET:
            raise SourceFailed(
                "unsupported",
                f"{FIELD}: a fleet:// source has no origin to ask: the node copies it from "
                "a node that holds it (agent.fetch_plan)",
            )
        if self._session is not None:
            return await self._resolve(self._session, source, token)
        async with aiohttp.ClientSession() as session:
            return await self._resolve(session, source, token)

    async def _resolve(
        self, session: aiohttp.ClientSession, source: ModelSource, token: str | None
    ) -> Manifest:
        if source.kind is SourceKind.HF:
            return await self._hf(session, source, token)
        if source.kind is SourceKind.MODELSCOPE:
            return await self._modelscope(session, source, token)
        return await self._url(session, source, token)

    async def _json(
        self, session: aiohttp.ClientSession, url: str, token: str | None, what: str,
        form: TokenForm = "bearer",
    ) -> Any:
        async with request(
            session, "GET", url, token=token, form=form, timeout=self.timeout
        ) as resp:
            if resp.status != 200:
                raise status_failure(
                    resp.status, url, what, resp.headers.get("X-Error-Code", "")
                )
            body = await resp.content.read(MAX_LISTING_BYTES + 1)
        if len(body) > MAX_LISTING_BYTES:
            raise SourceFailed("invalid", f"{FIELD}: the listing of {what} is too large")
        try:
            return json.loads(body)
        except ValueError:
            raise SourceFailed(
                "invalid", f"{FIELD}: {shown(url)} did not answer JSON for {what}"
            ) from None

    async def _hf(
        self, session: aiohttp.ClientSession, source: ModelSource, token: str | None
    ) -> Manifest:
        repo, rev = source.location, source.revision or "main"
        what = f"hf://{repo}@{rev}"
        url = f"{self.hf_endpoint}/api/models/{repo}/revision/{quote(rev, safe='')}?blobs=true"
        info = await self._json(session, url, token, what)
        commit = info.get("sha") if isinstance(info, dict) else None
        siblings = info.get("siblings") if isinstance(info, dict) else None
        if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):
            raise SourceFailed("invalid", f"{FIELD}: the hub named no commit for {what}")
        if not isinstance(siblings, list):
            raise SourceFailed("invalid", f"{FIELD}: the hub listed no files for {what}")
        files = []
        for s in siblings:
            path = s.get("rfilename") if isinstance(s, dict) else None
            if not isinstance(path, str) or safe_relative(path) is None:
                raise SourceFailed("invalid", f"{FIELD}: the hub listed an unsafe file "
                                   f"name in {what}: {path!r}")
            lfs = s.get("lfs") if isinstance(s.get("lfs"), dict) else {}
            size = lfs.get("size", s.get("size"))
            sha = lfs.get("sha256")
            files.append(ManifestFile(
                path=path,
                size=size if isinstance(size, int) else None,
                sha256=sha if isinstance(sha, str) and len(sha) == 64 else None,
                url=f"{self.hf_endpoint}/{repo}/resolve/{commit}/{quote(path)}",
            ))
        if not files:
            raise SourceFailed("not_found", f"{FIELD}: {what} holds no files")
        return Manifest(source, commit, tuple(files))

    async def _modelscope(
        self, session: aiohttp.ClientSession, source: ModelSource, token: str | None
    ) -> Manifest:
        repo, rev = source.location, source.revision or "master"
        what = f"modelscope://{repo}@{rev}"
        base = f"{self.modelscope_endpoint}/api/v1/models/{repo}"
        url = f"{base}/repo/files?Revision={quote(rev, safe='')}&Recursive=true"
        info = await self._json(session, url, token, what, form="modelscope")
        data = info.get("Data") if isinstance(info, dict) else None
        listed = data.get("Files") if isinstance(data, dict) else None
        if not isinstance(listed, list):
            code = info.get("Code") if isinstance(info, dict) else None
            if code in (404, "404"):
                raise SourceFailed("not_found", f"{FIELD}: {what} was not found")
            raise SourceFailed("invalid", f"{FIELD}: ModelScope listed no files for {what}")
        files = []
        for f in listed:
            if not isinstance(f, dict) or f.get("Type", "blob") != "blob":
                continue
            path = f.get("Path")
            if not isinstance(path, str) or safe_relative(path) is None:
                raise SourceFailed("invalid", f"{FIELD}: ModelScope listed an unsafe file "
                                   f"name in {what}: {path!r}")
            size, sha = f.get("Size"), f.get("Sha256")
            files.append(ManifestFile(
                path=path,
                size=size if isinstance(size, int) else None,
                sha256=sha.lower() if isinstance(sha, str) and len(sha) == 64 else None,
                url=f"{base}/repo?Revision={quote(rev, safe='')}&FilePath={quote(path)}",
            ))
        if not files:
            raise SourceFailed("not_found", f"{FIELD}: {what} holds no files")
        return Manifest(source, "", tuple(files))

    async def _url(
        self, session: aiohttp.ClientSession, source: ModelSource, token: str | None
    ) -> Manifest:
        url = source.location
        hops: list[Mapping[str, str]] = []
        async with request(session, "HEAD", url, token=token, timeout=self.timeout,
                           hops=hops) as resp:
            status, length = resp.status, resp.headers.get("Content-Length")
            hops.append(dict(resp.headers))
        size = int(length) if length and length.isdigit() else None
        linked = _linked_sha256(hops)  # a hub file's URL: its LFS SHA-256, on the way
        if status in (405, 501):  # a server that answers no HEAD: ask for one byte
            status, size = await self._first_byte(session, url, token)
        if status not in (200, 206):
            raise status_failure(status, url, shown(url))
        sha = linked or await self._sidecar(session, url + ".sha256", token)
        raw = posixpath.basename(urlsplit(url).path)
        name = unquote(raw)  # the file's name on disk, not its URL spelling
        if safe_relative(name) is None:
            name = raw
        return Manifest(source, "", (ManifestFile(name, size, sha, url),))

    async def _first_byte(
        self, session: aiohttp.ClientSession, url: str, token: str | None
    ) -> tuple[int, int | None]:
        """The status and the size a ``GET`` of byte 0 tells (``Content-Range``'s total,
        or ``Content-Length`` when the server sends the whole file, which is not read)."""
        async with request(session, "GET", url, token=token, headers={"Range": "bytes=0-0"},
                           timeout=self.timeout) as resp:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            if resp.status == 206 and total.isdigit():
                return 206, int(total)
            length = resp.headers.get("Content-Length", "")
            return resp.status, int(length) if resp.status == 200 and length.isdigit() else None

    async def _sidecar(
        self, session: aiohttp.ClientSession, url: str, token: str | None
    ) -> str | None:
        """The SHA-256 a ``.sha256`` file beside the URL gives, or None when there is
        none (any status but 200). A sidecar that is there but unreadable is refused:
        the server meant to give a checksum."""
        async with request(session, "GET", url, token=token, timeout=self.timeout) as resp:
            if resp.status != 200:
                return None
            body = await resp.content.read(4096)
        m = _SHA256_WORD.match(body.decode("utf-8", "replace").strip())
        if m is None:
            raise SourceFailed("invalid", f"{FIELD}: {shown(url)} is not a SHA-256 "
                               "checksum file")
        return m[1].lower()


def _linked_sha256(hops: list[Mapping[str, str]]) -> str | None:
    """The SHA-256 a Hugging Face ``resolve`` URL names for a file in LFS: its
    ``X-Linked-Etag`` (on the redirect to the CDN, or on the answer itself), the quoted
    hex digest; a git blob id (40 hex) or a CDN's own ETag is not one."""
    for headers in hops:
        tag = headers.get("X-Linked-Etag", "").strip().removeprefix("W/").strip('"')
        if _SHA256_WORD.match(tag):
            return tag.lower()
    return None
