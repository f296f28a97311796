"""vLLM's sleep routes, as the agent calls them over the node's loopback (F1, F2).

``POST /sleep?level=N``, ``GET /is_sleeping`` (``{"is_sleeping": bool}``) and ``POST
/wake_up``: served by vLLM's OpenAI server only with ``VLLM_SERVER_DEV_MODE=1``, and only
the agent reaches them — the engine's door answers 404 for them from the network (C14).
Each call carries the engine's key. A route that answers an error, or does not answer in
``timeout_s``, raises ``EngineSleepError`` with what happened, so the caller can fall back
to stopping the engine and say why.
"""

from __future__ import annotations

from typing import Any

import aiohttp

__all__ = ["EngineSleepError", "VllmSleep"]


class EngineSleepError(RuntimeError):
    """A sleep route failed; the message says which and how."""


class VllmSleep:
    """The sleep routes of one engine at ``base_url`` (``http://host:port``)."""

    def __init__(
        self, session: aiohttp.ClientSession, base_url: str, engine_key: str, timeout_s: float
    ) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {engine_key}"} if engine_key else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def sleep(self, level: int) -> None:
        await self._call("POST", f"/sleep?level={level}")

    async def wake_up(self) -> None:
        await self._call("POST", "/wake_up")

    async def is_sleeping(self) -> bool:
        body = await self._call("GET", "/is_sleeping")
        value = body.get("is_sleeping") if isinstance(body, dict) else None
        if not isinstance(value, bool):
            raise EngineSleepError(f"/is_sleeping answered {body!r}, not {{'is_sleeping': bool}}")
        return value

    async def _call(self, method: str, path: str) -> Any:
        route = path.split("?", 1)[0]
        try:
            async with self._session.request(
                method, self._base + path, headers=self._headers, timeout=self._timeout
            ) as r:
                if r.status >= 300:
                    text = (await r.text())[:200].strip()
                    raise EngineSleepError(f"{route} answered HTTP {r.status}: {text or 'no body'}")
                if r.content_type == "application/json":
                    return await r.json()
                return None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise EngineSleepError(f"{route} not answered ({type(exc).__name__})") from exc
