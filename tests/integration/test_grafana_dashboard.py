"""The Grafana dashboard in the repo (deploy/grafana/heteroflow.json) cannot drift (P3).

Every metric name in every panel's PromQL must be one the code exports, collected by
scraping the real thing: the server's port (the in-process gateway's series and the
server's), a standalone gateway, and an agent's metrics port. A histogram family exports
``_bucket``, ``_sum`` and ``_count``; families are read from their ``# TYPE`` lines, so a
series that has no sample yet (no wake so far, say) still counts as exported.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.agent.metrics import AgentMetrics, serve_metrics
from heteroflow.schemas.routing import SnapshotHolder
from tests.gateway_stack import serve_gateway
from tests.integration.conftest import Api

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "heteroflow.json"
_TYPE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$")
_NAME = re.compile(r"\bheteroflow_[a-z0-9_]+\b")


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def expressions(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    return [
        (p["title"], t["expr"])
        for p in panels(dashboard["panels"])
        for t in p.get("targets", [])
    ]


def exported(text: str) -> set[str]:
    names: set[str] = set()
    for line in text.splitlines():
        m = _TYPE.match(line)
        if m is None:
            continue
        name, kind = m[1], m[2]
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return names


def scrape_agent() -> str:
    async def run() -> str:
        stop = asyncio.Event()
        port: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        metrics = AgentMetrics("node-a")
        text = lambda: metrics.render({})  # noqa: E731
        served = asyncio.create_task(serve_metrics(text, "127.0.0.1", 0, stop, port.set_result))
        try:
            async with httpx.AsyncClient() as http:
                r = await http.get(f"http://127.0.0.1:{await port}/metrics", timeout=5)
                return r.text
        finally:
            stop.set()
            await served

    return asyncio.run(run())


def scrape_gateway() -> str:
    with serve_gateway(SnapshotHolder()) as gw:
        return httpx.get(f"{gw.url}/metrics", timeout=5).text


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    d = json.loads(DASHBOARD.read_text())
    assert d["uid"] == "heteroflow" and d["schemaVersion"] >= 36
    assert [v["name"] for v in d["templating"]["list"]] == ["datasource"]
    every = list(panels(d["panels"]))
    assert len({p["id"] for p in every}) == len(every)  # ids unique
    for p in every:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"], p["title"]


@pytest.mark.feature("P3")
def test_every_series_the_dashboard_asks_for_is_exported(api: Api) -> None:
    server = api.client.get("/metrics").text
    names = exported(server) | exported(scrape_gateway()) | exported(scrape_agent())
    # what each part exports, at least: the scrapes really reached all three
    assert {"heteroflow_gateway_in_flight", "heteroflow_server_tasks"} <= names
    assert "heteroflow_agent_launches_total" in names
    asked = expressions(json.loads(DASHBOARD.read_text()))
    assert len(asked) >= 20
    missing = {
        (title, name)
        for title, expr in asked
        for name in _NAME.findall(expr)
        if name not in names
    }
    assert not missing, f"the dashboard asks for series nobody exports: {sorted(missing)}"
    for title, expr in asked:
        assert _NAME.search(expr), f"{title!r} queries no HeteroFlow series: {expr}"
    # and each part's series are on the dashboard (a panel per part, at least)
    used = {name for _, expr in asked for name in _NAME.findall(expr)}
    for part in ("gateway", "server", "agent"):
        assert any(n.startswith(f"heteroflow_{part}_") for n in used), part
