"""HeteroFlow's gateway in the shared benchmark's gateway slot.

Runs the production ``GatewayApp`` (the same object the server mounts on /v1) with a
fixed routing snapshot: one key, model ``fake-model`` routed to ``--upstream`` (the
harness's fake backend). Only the snapshot source differs from production.

    python bench/gateway_slot.py --port 18090 --upstream http://127.0.0.1:18000/v1 --key sk-bench
"""

from __future__ import annotations

import argparse
import asyncio

from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.snapshot import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.server import bind, http_server


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="backend base URL (with or without /v1)")
    p.add_argument("--key", required=True)
    p.add_argument("--model", default="fake-model")
    a = p.parse_args()
    base = a.upstream.rstrip("/").removesuffix("/v1")
    snap = RoutingSnapshot(
        version=1,
        keys={hash_key(a.key): KeyEntry("ep-bench", "tn-bench", "tg-bench", frozenset({a.model}))},
        routes={
            ("tn-bench", a.model): (
                RouteTarget("mr-bench", "tg-bench", 0, 100, (Backend("task-bench", base),)),
            )
        },
    )
    # the same uvicorn settings the server and the standalone gateway use
    server = http_server(GatewayApp(SnapshotHolder(snap)))
    asyncio.run(server.serve(sockets=[bind("127.0.0.1", a.port)]))


if __name__ == "__main__":
    main()
