"""One container health probe (FEATURES D1/D3): run the check once, report (ok, detail).

The agent calls ``probe`` with the HOST address and port that map to the config's
container port; judging the results over time belongs to ``core.health.HealthTracker``.
Network failures never raise: they come back as ``(False, detail)`` where the detail names
the kind of failure ("connection refused", "timeout after 3s", "HTTP 500", ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

from heteroflow.core.health import HealthCheckConfig

#: How much of a failing answer is read for its message (llama.cpp's 503 "Loading model").
_BODY_READ = 1024
_SAID_MAX = 120


def _said(body: bytes) -> str:
    """The message of an OpenAI-style error body (``{"error": {"message": ...}}``), short
    and on one line; "" when the body is not one. D5: "Loading model" is how llama.cpp
    says it is still loading."""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    error = data.get("error") if isinstance(data, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    if not isinstance(message, str):
        return ""
    return " ".join(message.split())[:_SAID_MAX]


def _host_for_url(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _describe(exc: BaseException, timeout_s: float) -> str:
    """A short, stable description of a network failure."""
    if isinstance(exc, TimeoutError | aiohttp.ServerTimeoutError):
        return f"timeout after {timeout_s:g}s"
    cause: BaseException | None = exc
    if isinstance(exc, aiohttp.ClientConnectorError):
        cause = exc.os_error
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused"
    if isinstance(cause, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "server disconnected"
    if isinstance(cause, OSError) and cause.strerror:
        return f"connection error: {cause.strerror}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _probe_http(
    config: HealthCheckConfig, host: str, port: int, session: aiohttp.ClientSession, key: str
) -> tuple[bool, str]:
    url = f"http://{_host_for_url(host)}:{port}{config.path}"
    timeout = aiohttp.ClientTimeout(total=config.timeout_s)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    try:
        async with session.get(
            url, timeout=timeout, allow_redirects=False, headers=headers
        ) as response:
            ok = 200 <= response.status < 300
            if ok:
                return True, f"HTTP {response.status}"
            try:
                said = _said(await response.content.read(_BODY_READ))
            except (aiohttp.ClientError, OSError, TimeoutError):
                said = ""
            return False, f"HTTP {response.status}" + (f": {said}" if said else "")
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        return False, _describe(exc, config.timeout_s)


async def _probe_tcp(config: HealthCheckConfig, host: str, port: int) -> tuple[bool, str]:
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port), timeout=config.timeout_s
        )
    except (OSError, TimeoutError, ValueError) as exc:
        return False, _describe(exc, config.timeout_s)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True, "tcp connect ok"


async def probe(
    config: HealthCheckConfig,
    host: str,
    port: int,
    session: aiohttp.ClientSession | None = None,
    key: str = "",
) -> tuple[bool, str]:
    """Run ``config``'s check once against ``host:port``; never raises for network errors.

    http: ``GET http://host:port{path}`` within ``timeout_s`` (redirects not followed);
    ok iff the status is 2xx, detail ``"HTTP <status>"`` (a failing answer's error message
    after a colon: ``"HTTP 503: Loading model"``). tcp: ok iff a connection opens
    within ``timeout_s``. Pass a shared ``session`` to reuse connections; without one a
    session is opened for this probe and closed after it. ``key``: the engine's own key
    (C14), sent as a bearer token — an engine whose key guards the checked path answers.
    """
    if config.type == "tcp":
        return await _probe_tcp(config, host, port)
    if session is not None:
        return await _probe_http(config, host, port, session, key)
    async with aiohttp.ClientSession() as own:
        return await _probe_http(config, host, port, own, key)
