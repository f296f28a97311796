"""Keeps a stand-alone gateway's routing snapshot in step with the server.

A gateway running in its own process has no database; it polls the server's
``GET /api/v1/gateway/snapshot`` (``RoutingSnapshot.to_wire()`` JSON, ``ETag: "<version>"``)
with ``If-None-Match`` so that an unchanged snapshot costs a bodiless 304. Any failure
keeps the last snapshot: the gateway goes on routing on slightly old data rather than
refusing traffic while the server is briefly away.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import orjson

from heteroflow.schemas.routing import RoutingSnapshot, SnapshotHolder

logger = logging.getLogger(__name__)

SNAPSHOT_PATH = "/api/v1/gateway/snapshot"
# While the server stays unreachable, repeat the warning at most this often.
_WARN_EVERY_S = 60.0


class PollError(Exception):
    """One poll failed; the message is safe to log (it never contains the token)."""


class SnapshotPoller:
    def __init__(
        self, server_url: str, token: str, holder: SnapshotHolder, interval_s: float = 1.0
    ) -> None:
        self._url = server_url.rstrip("/") + SNAPSHOT_PATH
        self._auth = f"Bearer {token}"
        self._holder = holder
        self._interval = interval_s
        self._timeout = aiohttp.ClientTimeout(total=max(5.0, 2 * interval_s))
        self._session: aiohttp.ClientSession | None = None
        self._failing_since: float | None = None
        self._last_warning = 0.0

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every ``interval_s`` until ``stop`` is set; never raises on poll errors."""
        try:
            while not stop.is_set():
                try:
                    await self.poll_once()
                except PollError as exc:
                    self._report_failure(str(exc))
                else:
                    if self._failing_since is not None:
                        logger.info(
                            "routing snapshot: server reachable again (version %d)",
                            self._holder.current.version,
                        )
                        self._failing_since = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self._interval)
        finally:
            await self.aclose()

    async def poll_once(self) -> bool:
        """One poll; True when a new snapshot was published, False on 304.

        Raises ``PollError`` on any failure, the current snapshot being left in place.
        """
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        headers = {
            "Authorization": self._auth,
            "If-None-Match": f'"{self._holder.current.version}"',
        }
        try:
            async with self._session.get(self._url, headers=headers) as resp:
                if resp.status == 304:
                    return False
                if resp.status != 200:
                    raise PollError(f"HTTP {resp.status} from {self._url}")
                raw = await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PollError(f"{type(exc).__name__} polling {self._url}") from exc
        try:
            snapshot = RoutingSnapshot.from_wire(orjson.loads(raw))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise PollError(f"malformed snapshot from {self._url}: {type(exc).__name__}") from exc
        self._holder.publish(snapshot)
        return True

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _report_failure(self, message: str) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
        elif now - self._last_warning < _WARN_EVERY_S:
            logger.debug("routing snapshot poll failed: %s", message)
            return
        self._last_warning = now
        logger.warning(
            "routing snapshot poll failed (%s); keeping version %d, failing for %.0f s",
            message,
            self._holder.current.version,
            now - self._failing_since,
        )
