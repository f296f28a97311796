"""``heteroflow platform``: the operators' switches (L1) from the command line."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from heteroflow import cli
from heteroflow.cmd import remote

SWITCHES = {"inference_dedup_enabled": True, "cross_tenant_dedup_enabled": False}


def _serve(monkeypatch: pytest.MonkeyPatch, status: int, answer: Any) -> list[tuple[str, Any]]:
    seen: list[tuple[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        seen.append((f"{request.method} {request.url.path}", body))
        return httpx.Response(status, json=answer)

    monkeypatch.setattr(
        remote,
        "_client",
        lambda server=None: httpx.Client(
            base_url="http://hf.test", transport=httpx.MockTransport(handle)
        ),
    )
    return seen


@pytest.mark.feature("L1")
@pytest.mark.parametrize(
    ("argv", "body"),
    [
        (["--inference-dedup", "on"], {"inference_dedup_enabled": True}),
        (
            ["--inference-dedup", "off", "--cross-tenant-dedup", "on"],
            {"inference_dedup_enabled": False, "cross_tenant_dedup_enabled": True},
        ),
    ],
)
def test_set_sends_only_the_switches_given(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], body: dict[str, bool]
) -> None:
    seen = _serve(monkeypatch, 200, SWITCHES)
    assert cli.main(["platform", "set", *argv]) == 0
    assert seen == [("PUT /api/v1/platform-settings", body)]


def test_show_prints_each_switch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _serve(monkeypatch, 200, SWITCHES)
    assert cli.main(["platform", "show"]) == 0
    assert seen == [("GET /api/v1/platform-settings", None)]
    out = capsys.readouterr().out
    assert "inference_dedup_enabled" in out and "cross_tenant_dedup_enabled" in out


def test_set_without_a_switch_is_refused_before_any_request(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _serve(monkeypatch, 200, SWITCHES)
    assert cli.main(["platform", "set"]) != 0
    assert seen == []
    assert "--inference-dedup" in capsys.readouterr().err


def test_a_member_is_told_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _serve(monkeypatch, 403, {"detail": "only a platform operator changes platform settings"})
    assert cli.main(["platform", "set", "--inference-dedup", "on"]) != 0
    assert "operator" in capsys.readouterr().err
