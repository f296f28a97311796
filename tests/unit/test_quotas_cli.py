"""``heteroflow tenants update --quota-*`` and ``tenants quota`` (N2): the request sent
and what is printed, against a scripted API."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from heteroflow import cli

from .test_cli import Recorder, server  # noqa: F401 - a fixture

QUOTA = {
    "tenant_id": "tn-2", "tenant_name": "team-a",
    "limits": {"cards": 4, "services": 0, "replicas": 6, "cpu_memory_mb": 8192},
    "usage": {"cards": 2.5, "services": 2, "replicas": 3, "cpu_memory_mb": 1024},
}


@pytest.mark.feature("N2")
def test_operators_set_quotas_from_the_cli(server: Callable[..., Recorder]) -> None:  # noqa: F811
    rec = server((200, {"id": "tn-2", "name": "team-a", "quota_cards": 4}))
    argv = ["tenants", "update", "tn-2", "--quota-cards", "4", "--quota-services", "0",
            "--quota-replicas", "6", "--quota-cpu-memory-mb", "8192"]
    assert cli.main(argv) == 0
    assert rec.requests == [(
        "PATCH", "/api/v1/tenants/tn-2",
        {"quota_cards": 4, "quota_services": 0, "quota_replicas": 6,
         "quota_cpu_memory_mb": 8192},
    )]


def test_quota_shows_usage_against_limits(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    rec = server((200, QUOTA))
    assert cli.main(["tenants", "quota", "tn-2"]) == 0
    assert rec.requests == [("GET", "/api/v1/tenants/tn-2/quota", None)]
    out = capsys.readouterr().out
    assert "cards:" in out and "2.5 of 4" in out
    assert "2 (no limit)" in out  # services
    assert "3 of 6" in out and "1024 of 8192" in out
