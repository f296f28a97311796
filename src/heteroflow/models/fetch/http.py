"""HTTP for model sources: one request with redirects followed by hand, errors as reasons.

Redirects are followed here, not by aiohttp, so that the token (an ``Authorization``
header, or ModelScope's session cookie) goes only to the origin it was given for: a hub
answers a file with a redirect to its CDN, and the CDN must not see the token.
``http://`` to a host that is not loopback never gets a token (``insecure``): tokens
never travel in clear.

Every failure becomes a ``SourceFailed`` with a message this module writes itself (the
URL without its query, the status, the exception's class): never a header, never the
token.
"""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from yarl import URL

from heteroflow.core.model_sources import SourceKind
from heteroflow.models.fetch.manifest import SourceFailed

TokenForm = Literal["bearer", "modelscope"]
#: Signs one request to another node's agent (``core.node_signature``): (method, URL) →
#: the ``Authorization`` value. It goes to its first origin only, as a token does.
Signer = Callable[[str, str], str]

MAX_REDIRECTS = 5
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def shown(url: str) -> str:
    """``url`` as it may appear in a message or a log: no user info, no query."""
    p = urlsplit(url)
    host = p.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{p.port}" if p.port else "")
    return urlunsplit((p.scheme, netloc, p.path, "", ""))


def origin(url: str) -> tuple[str, str, int | None]:
    p = urlsplit(url)
    return (p.scheme.lower(), (p.hostname or "").lower(), p.port)


def in_clear(url: str) -> bool:
    """Whether a request to ``url`` would cross a network unencrypted."""
    p = urlsplit(url)
    if p.scheme.lower() != "http":
        return False
    host = (p.hostname or "").lower()
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def token_form(kind: SourceKind) -> TokenForm:
    """How a source's hub takes a token: Hugging Face (and a web server) as
    ``Authorization: Bearer``; ModelScope as its session cookie ``m_session_id`` (what
    its SDK's ``HubApi.get_cookies(access_token)`` sends)."""
    return "modelscope" if kind is SourceKind.MODELSCOPE else "bearer"


def credential(token: str | None, url: str, form: TokenForm = "bearer") -> dict[str, str]:
    """The header that carries ``token`` to ``url``, or none; refuses a token in clear."""
    if not token:
        return {}
    if in_clear(url):
        raise SourceFailed(
            "insecure",
            f"task.model_path: refusing to send a token over plain http to {shown(url)}; "
            "the endpoint must be https (or on the loopback interface)",
        )
    if form == "modelscope":
        return {"Cookie": f"m_session_id={token}"}
    return {"Authorization": f"Bearer {token}"}


@asynccontextmanager
async def request(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    *,
    token: str | None = None,
    form: TokenForm = "bearer",
    headers: Mapping[str, str] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
    signer: Signer | None = None,
    hops: list[Mapping[str, str]] | None = None,
) -> AsyncIterator[aiohttp.ClientResponse]:
    """One request; redirects followed with the token (or the signature) kept to its
    first origin. ``hops`` gets the headers of each redirect answered on the way (a
    hub's file metadata rides on its redirect to the CDN)."""
    home = origin(url)
    current = url
    for _ in range(MAX_REDIRECTS + 1):
        sent = dict(headers or {})
        if token and origin(current) == home:
            sent.update(credential(token, current, form))
        if signer is not None and origin(current) == home:
            sent["Authorization"] = signer(method, current)
        try:
            resp = await session.request(
                method, URL(current), headers=sent,
                allow_redirects=False, timeout=timeout or aiohttp.ClientTimeout(),
            )
        except TimeoutError:
            raise SourceFailed(
                "timeout", f"task.model_path: {shown(current)} did not answer in time"
            ) from None
        except aiohttp.ClientError as e:
            raise SourceFailed(
                "unreachable",
                f"task.model_path: {shown(current)} could not be reached "
                f"({type(e).__name__})",
            ) from None
        if resp.status in _REDIRECTS and "Location" in resp.headers:
            if hops is not None:
                hops.append(dict(resp.headers))
            target = str(URL(current).join(URL(resp.headers["Location"])))
            resp.release()
            if urlsplit(target).scheme.lower() not in ("http", "https"):
                raise SourceFailed("invalid", f"task.model_path: {shown(current)} "
                                   "redirected to a URL that is not http(s)")
            current = target
            continue
        try:
            yield resp
        finally:
            resp.release()
        return
    raise SourceFailed("unreachable", f"task.model_path: {shown(url)} redirected too often")


def status_failure(status: int, url: str, what: str, error_code: str = "") -> SourceFailed:
    """A non-success status as a reason: 401/403 unauthorized, 404 not found, else
    unreachable (the server answered, but not with the file)."""
    where = shown(url)
    if status == 404 or error_code in ("RepoNotFound", "RevisionNotFound", "EntryNotFound"):
        private = " or is private and the token cannot read it" if status in (401, 403) else ""
        return SourceFailed(
            "not_found",
            f"task.model_path: {what} was not found{private} ({where} answered {status})",
        )
    if status in (401, 403) or error_code == "GatedRepo":
        return SourceFailed(
            "unauthorized",
            f"task.model_path: {what} needs a token that may read it ({where} answered "
            f"{status}; a private repository also answers so when it is not found)",
        )
    return SourceFailed(
        "unreachable", f"task.model_path: {where} answered {status} for {what}"
    )
