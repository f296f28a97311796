"""A stand-in for the model hubs and a file server, for tests: no test machine reaches
huggingface.co or modelscope.cn, so this serves their routes the way their clients ask.

Hugging Face (the routes ``huggingface_hub`` uses):
``GET /api/models/{org}/{name}/revision/{rev}[?blobs=true]`` → ``{"id", "sha",
"siblings": [{"rfilename", "size", "blobId", "lfs": {"size", "sha256", "pointerSize"}}]}``
(sizes and ``lfs`` only with ``blobs``), and ``GET|HEAD /{org}/{name}/resolve/{rev}/{path}``
→ the file, with ``X-Repo-Commit``. A private repository answers 401 with
``X-Error-Code: RepoNotFound`` without the right ``Authorization: Bearer``, as the hub does.
When ``cdn_base`` is set, ``resolve`` redirects (302) there, as the hub redirects to its
CDN; the CDN route records the Authorization headers it saw.

ModelScope (the routes its SDK uses): ``GET /api/v1/models/{org}/{name}/repo/files``
→ ``{"Code": 200, "Data": {"Files": [{"Name", "Path", "Type", "Size", "Sha256"}]}}`` and
``GET /api/v1/models/{org}/{name}/repo?Revision=&FilePath=`` → the file; a private
repository there wants the token as the ``m_session_id`` cookie, as ModelScope does.

A plain web server: ``GET|HEAD /files/{path}`` (HEAD refused with 405 when ``head`` is
False) and ``/files/{path}.sha256`` when ``sidecars`` holds it.

Every file answer honours ``Range: bytes=N-`` and ``bytes=N-M`` with a 206 (unless
``ranges`` is False).
``rate_bytes_s`` > 0 paces every file body to about that rate (a slow link: the
download's share of a cold start shows, bench/cold_start.py).
Faults: ``cut_once`` (paths whose next answer stops halfway and drops the connection),
``corrupt`` (paths served with other bytes than listed). ``requests`` records
``(method, path, Range header)`` for every request; ``auth_seen`` every Authorization
and Cookie header by path. Production code never imports this module.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    lfs: frozenset[str] = frozenset()  # paths listed with an LFS sha256
    commit: str = COMMIT
    branches: tuple[str, ...] = ("main", "master")
    token: str | None = None  # set: private, readable with this token only


@dataclass
class ModelHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # the /files/ server
    sidecars: dict[str, str] = field(default_factory=dict)  # path → .sha256 body
    ranges: bool = True
    cut_once: set[str] = field(default_factory=set)
    rate_bytes_s: float = 0.0  # > 0: file bodies paced to about this rate
    corrupt: set[str] = field(default_factory=set)
    cdn_base: str = ""
    head: bool = True  # False: the /files/ server answers HEAD with 405
    requests: list[tuple[str, str, str]] = field(default_factory=list)
    auth_seen: dict[str, list[str]] = field(default_factory=dict)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._record])
        r = app.router
        r.add_get("/api/models/{org}/{name}/revision/{rev}", self._hf_info)
        r.add_get("/api/models/{org}/{name}", self._hf_info)  # the default branch
        r.add_get("/api/models/{org}/{name}/tree/{rev}", self._hf_tree)
        r.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.+}", self._hf_resolve)
        r.add_get("/api/v1/models/{org}/{name}/repo/files", self._ms_files)
        r.add_get("/api/v1/models/{org}/{name}/repo", self._ms_file)
        r.add_route("*", "/cdn/{org}/{name}/{path:.+}", self._cdn)
        r.add_route("*", "/files/{path:.+}", self._plain)
        return app

    def fetches(self, path_end: str) -> list[tuple[str, str, str]]:
        """The GETs of a file whose request path ends with ``path_end``."""
        return [q for q in self.requests if q[0] == "GET" and q[1].endswith(path_end)]

    @web.middleware
    async def _record(
        self, request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs, request.headers.get("Range", "")))
        for header in ("Authorization", "Cookie"):
            if header in request.headers:
                self.auth_seen.setdefault(request.path, []).append(request.headers[header])
        return await handler(request)

    def _repo(self, request: web.Request) -> Repo:
        repo = self.repos.get(f"{request.match_info['org']}/{request.match_info['name']}")
        # Hugging Face takes a bearer token; ModelScope its session cookie
        modelscope = request.path.startswith("/api/v1/")
        given = (request.cookies.get("m_session_id") if modelscope
                 else request.headers.get("Authorization", "").removeprefix("Bearer "))
        if repo is None or (repo.token and given != repo.token):
            raise web.HTTPUnauthorized(
                headers={"X-Error-Code": "RepoNotFound"}, text="Repository not found"
            )
        return repo

    def _revision(self, repo: Repo, rev: str) -> None:
        if rev not in (repo.commit, *repo.branches):
            raise web.HTTPNotFound(headers={"X-Error-Code": "RevisionNotFound"})

    async def _hf_info(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        self._revision(repo, request.match_info.get("rev", "main"))
        blobs = request.query.get("blobs") in ("true", "True", "1")
        siblings = []
        for path, body in repo.files.items():
            s: dict[str, object] = {"rfilename": path}
            if blobs:
                s["size"] = len(body)
                s["blobId"] = hashlib.sha1(body).hexdigest()  # noqa: S324 (git's blob id)
                if path in repo.lfs:
                    s["lfs"] = {"size": len(body), "sha256": hashlib.sha256(body).hexdigest(),
                                "pointerSize": 134}
            siblings.append(s)
        name = f"{request.match_info['org']}/{request.match_info['name']}"
        return web.json_response({"id": name, "sha": repo.commit, "siblings": siblings})

    async def _hf_tree(self, request: web.Request) -> web.Response:
        """The listing ``snapshot_download`` asks for (recursive; no folders listed)."""
        repo = self._repo(request)
        self._revision(repo, request.match_info["rev"])
        entries = []
        for path, body in repo.files.items():
            e: dict[str, object] = {
                "type": "file", "path": path, "size": len(body),
                "oid": hashlib.sha1(body).hexdigest(),  # noqa: S324 (git's blob id)
            }
            if path in repo.lfs:
                e["lfs"] = {"oid": hashlib.sha256(body).hexdigest(), "size": len(body),
                            "pointerSize": 134}
            entries.append(e)
        return web.json_response(entries)

    async def _hf_resolve(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        self._revision(repo, request.match_info["rev"])
        path = request.match_info["path"]
        if path not in repo.files:
            raise web.HTTPNotFound(headers={"X-Error-Code": "EntryNotFound"})
        body = repo.files[path]
        # the hub's file metadata headers: the commit, and an ETag that is the LFS
        # sha256 (X-Linked-* for a file in LFS) or the git blob id
        headers = {"X-Repo-Commit": repo.commit}
        if path in repo.lfs:
            sha = _digest("sha256", body)
            headers |= {"ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(len(body))}
        else:
            headers["ETag"] = f'"{_digest("sha1", body)}"'  # git's blob id
        if self.cdn_base:
            org, name = request.match_info["org"], request.match_info["name"]
            raise web.HTTPFound(f"{self.cdn_base}/cdn/{org}/{name}/{path}", headers=headers)
        return await self._send(request, path, body, headers)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        repo = self.repos[f"{request.match_info['org']}/{request.match_info['name']}"]
        path = request.match_info["path"]
        return await self._send(request, path, repo.files[path], {})

    async def _ms_files(self, request: web.Request) -> web.Response:
        repo = self._repo(request)
        self._revision(repo, request.query.get("Revision", "master"))
        files = [
            {"Name": p.rsplit("/", 1)[-1], "Path": p, "Type": "blob", "Size": len(b),
             "Sha256": hashlib.sha256(b).hexdigest(), "Revision": repo.commit}
            for p, b in repo.files.items()
        ]
        return web.json_response({"Code": 200, "Data": {"Files": files}})

    async def _ms_file(self, request: web.Request) -> web.StreamResponse:
        repo = self._repo(request)
        self._revision(repo, request.query.get("Revision", "master"))
        path = request.query.get("FilePath", "")
        if path not in repo.files:
            raise web.HTTPNotFound()
        return await self._send(request, path, repo.files[path], {})

    async def _plain(self, request: web.Request) -> web.StreamResponse:
        path = request.match_info["path"]
        if request.method == "HEAD" and not self.head:
            raise web.HTTPMethodNotAllowed("HEAD", ["GET"])
        if path.endswith(".sha256") and path[: -len(".sha256")] in self.sidecars:
            return web.Response(text=self.sidecars[path[: -len(".sha256")]])
        if path not in self.files:
            raise web.HTTPNotFound()
        return await self._send(request, path, self.files[path], {})

    async def _send(
        self, request: web.Request, path: str, body: bytes, headers: dict[str, str]
    ) -> web.StreamResponse:
        if path in self.corrupt:
            body = bytes(b ^ 0xFF for b in body)
        start, end = 0, len(body)  # served: body[start:end]
        rng = re.fullmatch(r"bytes=(\d+)-(\d*)", request.headers.get("Range", ""))
        if self.ranges and rng:
            start = int(rng[1])
            end = min(int(rng[2]) + 1, len(body)) if rng[2] else len(body)
            if start >= len(body) or start >= end:
                raise web.HTTPRequestRangeNotSatisfiable(
                    headers={"Content-Range": f"bytes */{len(body)}"}
                )
        partial = (start, end) != (0, len(body)) or bool(rng and self.ranges)
        resp = web.StreamResponse(status=206 if partial else 200, headers=headers)
        resp.content_length = end - start
        resp.headers["Accept-Ranges"] = "bytes" if self.ranges else "none"
        if partial:
            resp.headers["Content-Range"] = f"bytes {start}-{end - 1}/{len(body)}"
        await resp.prepare(request)
        if request.method == "HEAD":
            return resp
        if path in self.cut_once:
            self.cut_once.discard(path)
            half = start + (end - start) // 2
            await resp.write(body[start:half])
            assert request.transport is not None
            request.transport.close()  # the connection drops mid-file
            return resp
        if self.rate_bytes_s > 0:
            await self._paced(resp, memoryview(body)[start:end])
        else:
            await resp.write(body[start:end])
        await resp.write_eof()
        return resp

    async def _paced(self, resp: web.StreamResponse, data: memoryview) -> None:
        """``data`` in 64 KiB writes, each held back until the rate allows it."""
        began, chunk = time.monotonic(), 1 << 16
        for at in range(0, len(data), chunk):
            sent = min(at + chunk, len(data))
            await resp.write(data[at:sent])
            ahead = sent / self.rate_bytes_s - (time.monotonic() - began)
            if ahead > 0:
                await asyncio.sleep(ahead)


@functools.lru_cache(maxsize=32)
def _digest(name: str, body: bytes) -> str:
    """``body``'s digest, computed once per body: a file answer hashed a benchmark's
    gigabyte on every HEAD and GET, the stand-in's time counted as the client's."""
    return hashlib.new(name, body).hexdigest()


@contextmanager
def serving(hub: ModelHub) -> Iterator[str]:
    """``hub`` served on the loopback from a thread of its own (its own event loop), as a
    real hub answers a server whose routes run in worker threads; yields its base URL."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(hub.app())
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = runner.addresses[0][1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()

