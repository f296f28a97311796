"""The gateway's backend monitor starts with the app and follows snapshot changes by
itself (issue 11): no request is needed for a dead backend to leave routing, and a
backend added by a later snapshot is probed without any request either."""

from __future__ import annotations

import asyncio
import socket

import pytest

from heteroflow.gateway.app import GatewayApp
from heteroflow.schemas.routing import (
    Backend,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
)


def dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def snapshot(version: int, *urls: str) -> RoutingSnapshot:
    target = RouteTarget(
        route_id="r", group_id="g", priority=0, weight=1, algorithm="round_robin",
        backends=tuple(Backend(task_id=f"t{i}", base_url=u) for i, u in enumerate(urls)),
    )
    return RoutingSnapshot(version=version, keys={}, routes={("tn", "m"): (target,)})


@pytest.mark.feature("M5")
async def test_probes_start_with_the_app_and_follow_new_snapshots_without_requests() -> None:
    first, second = dead_url(), dead_url()
    holder = SnapshotHolder(snapshot(1, first))
    app = GatewayApp(holder, probe_interval_s=0.05, probe_timeout_s=0.2)
    app.start()
    try:
        async def ejected(url: str) -> bool:
            for _ in range(100):
                if app._health.is_ejected(url):
                    return True
                await asyncio.sleep(0.05)
            return False

        assert await ejected(first), "the monitor should probe from start-up"
        holder.publish(snapshot(2, first, second))  # no request follows this change
        assert await ejected(second), "a backend of a newer snapshot should be probed"
    finally:
        await app.aclose()
