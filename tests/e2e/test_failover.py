"""Failover: two real ``heteroflow server`` processes on one PostgreSQL database.

Both run every loop; only the holder of the ``controllers`` lease runs the leader-only
ones. ``kill -9`` the leader (no clean release): the other must report itself leader
within the lease TTL plus one renew interval (and a margin for polling). Run with
``pytest -s`` to see the measured failover time.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import PG_ADMIN_URL, free_port

from .conftest import Proc, spawn, wait_for

pytestmark = pytest.mark.e2e

TTL_S = 2.0
RENEW_S = 0.5
MARGIN_S = 1.0  # polling, process scheduling on a loaded machine
ADMIN_PASSWORD = "failover-admin-password"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards."""
    try:
        import psycopg

        admin = psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3)
    except Exception as exc:  # pragma: no cover - depends on the machine
        if os.environ.get("HETEROFLOW_REQUIRE_POSTGRES") == "1":
            pytest.fail(f"PostgreSQL required but unreachable at {PG_ADMIN_URL}: {exc}")
        pytest.skip(f"failover needs PostgreSQL; not reachable at {PG_ADMIN_URL}: {exc}")
    name = f"hf_failover_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{PG_ADMIN_URL.rsplit('/', 1)[0]}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_kill_9_the_leader_and_the_other_leads_within_the_ttl(
    pg_url: str, tmp_path: Path
) -> None:
    procs: list[Proc] = []
    urls: list[str] = []

    def start(i: int) -> None:
        port = free_port()
        env = {
            "HETEROFLOW_DATABASE_URL": pg_url,
            "HETEROFLOW_DATA_DIR": str(tmp_path / f"server{i}"),
            "HETEROFLOW_ADMIN_PASSWORD": ADMIN_PASSWORD,
            "HETEROFLOW_NODE_TOKEN": "failover-node-token",
            "HETEROFLOW_GATEWAY_TOKEN": "failover-gateway-token",
            "HETEROFLOW_LEADER_LEASE_TTL_S": str(TTL_S),
            "HETEROFLOW_LEADER_RENEW_INTERVAL_S": str(RENEW_S),
        }
        procs.append(spawn(f"server{i}", ["server", "--port", str(port)], env, tmp_path))
        urls.append(f"http://127.0.0.1:{port}")
        wait_for(
            lambda: httpx.get(urls[i] + "/healthz", timeout=1).status_code == 200,
            30,
            f"server{i} /healthz",
        )

    try:
        start(0)  # one at a time: the first creates the schema
        start(1)
        r = httpx.post(
            urls[0] + "/api/v1/auth/login",
            json={"username": "admin", "password": ADMIN_PASSWORD},
        )
        assert r.status_code == 200, r.text
        headers = {"Authorization": f"Bearer {r.json()['access_token']}"}

        def servers(i: int) -> dict[str, Any]:
            resp = httpx.get(urls[i] + "/api/v1/servers", headers=headers, timeout=2)
            assert resp.status_code == 200, resp.text
            return dict(resp.json())

        def settled() -> dict[str, Any] | None:
            body = servers(0)
            return body if body["leader"] and len(body["instances"]) == 2 else None

        body = wait_for(settled, 15, "a leader and two instances", 0.1)
        pid_of = {inst["id"]: inst["pid"] for inst in body["instances"]}
        assert set(pid_of.values()) == {p.popen.pid for p in procs}
        leader = next(i for i, p in enumerate(procs) if p.popen.pid == pid_of[body["leader"]])
        survivor = 1 - leader
        survivor_id = next(k for k, v in pid_of.items() if v == procs[survivor].popen.pid)
        assert servers(survivor)["leader"] == body["leader"]  # both see the same leader

        procs[leader].popen.kill()  # SIGKILL: no release, the lease must run out
        killed_at = time.monotonic()
        procs[leader].popen.wait(10)
        new = wait_for(
            lambda: (b := servers(survivor))["leader"] == survivor_id and b,
            TTL_S + RENEW_S + 10,
            "the survivor to lead",
            0.05,
        )
        failover_s = time.monotonic() - killed_at
        print(f"\nfailover: {failover_s:.2f} s (lease TTL {TTL_S} s, renew {RENEW_S} s)")
        assert failover_s <= TTL_S + RENEW_S + MARGIN_S, procs[survivor].tail()
        assert new["epoch"] == body["epoch"] + 1
        assert "leads (lease controllers, epoch" in procs[survivor].log.read_text()
    except BaseException:
        print("\n".join(p.tail() for p in procs))
        raise
    finally:
        for p in procs:
            p.stop()
