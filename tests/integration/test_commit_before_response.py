"""A 2xx from the management API means the write is committed (never lost data).

FastAPI's default for a ``yield`` dependency ends it after the response is sent; our
unit of work must commit *before* the client hears "created". A slow commit makes the
difference observable: the row must be readable the moment the 201 arrives.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import event, select

from heteroflow.core.clock import FakeClock
from heteroflow.db.tables import Tenant
from heteroflow.server import ServerApp
from heteroflow.settings import ServerSettings
from heteroflow.testing.fake_openai_backend import UvicornThread

from .conftest import ADMIN_PASSWORD, NODE_TOKEN


def test_a_created_answer_means_committed(db_url: str, tmp_path: Path) -> None:
    settings = ServerSettings(
        data_dir=tmp_path / "data", database_url=db_url, admin_password=ADMIN_PASSWORD,
        node_token=NODE_TOKEN, gateway_token="gw-token-for-tests",
    )
    app = ServerApp(settings, clock=FakeClock())
    thread = UvicornThread()
    slow: list[float] = []

    def slow_commit(_session: Any) -> None:
        if slow:
            time.sleep(slow[0])

    event.listen(app.db._sessions, "before_commit", slow_commit)
    try:
        port = thread.serve(app.asgi)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            r = http.post("/api/v1/auth/login",
                          json={"username": "admin", "password": ADMIN_PASSWORD})
            admin = {"Authorization": f"Bearer {r.json()['access_token']}"}
            slow.append(0.4)
            r = http.post("/api/v1/tenants", json={"name": "acme"}, headers=admin)
            assert r.status_code == 201, r.text
            slow.clear()
            with app.db.session() as s:
                assert s.scalar(select(Tenant.name).where(Tenant.name == "acme")) == "acme"
    finally:
        event.remove(app.db._sessions, "before_commit", slow_commit)
        thread.stop()
        app.db.dispose()
