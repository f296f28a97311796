"""``heteroflow tenants update --members-see-own / --quota-tokens`` (N5, issue 16): the
request sent and what is printed, against a scripted API."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from heteroflow import cli

from .test_cli import Recorder, server  # noqa: F401 - a fixture

TENANT = {
    "id": "tn-2", "name": "team-a", "priority_ceiling": 100, "sharing_group_id": None,
    "quota_tokens": 500000, "quota_token_period": "month", "members_see_own": True,
    "created_at": "2026-01-01T00:00:00Z",
}


@pytest.mark.feature("N5")
def test_operators_switch_own_only_and_set_the_token_quota(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    rec = server((200, TENANT))
    argv = ["tenants", "update", "tn-2", "--members-see-own", "--quota-tokens", "500000",
            "--quota-token-period", "month"]
    assert cli.main(argv) == 0
    assert rec.requests == [(
        "PATCH", "/api/v1/tenants/tn-2",
        {"quota_tokens": 500000, "quota_token_period": "month", "members_see_own": True},
    )]
    out = capsys.readouterr().out
    assert "500000 per month" in out and "only their own" in out


@pytest.mark.feature("N5")
def test_no_members_see_own_sends_false_and_flags_left_out_are_not_sent(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    rec = server((200, {**TENANT, "members_see_own": False, "quota_tokens": 0}))
    assert cli.main(["tenants", "update", "tn-2", "--no-members-see-own"]) == 0
    assert rec.requests == [("PATCH", "/api/v1/tenants/tn-2", {"members_see_own": False})]
    out = capsys.readouterr().out
    assert "no limit" in out and "all" in out.split("members see", 1)[1].splitlines()[0]


def test_a_token_period_other_than_day_or_month_is_refused_before_any_request(
    server: Callable[..., Recorder], capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    rec = server((200, TENANT))
    with pytest.raises(SystemExit) as exc:
        cli.main(["tenants", "update", "tn-2", "--quota-token-period", "week"])
    assert exc.value.code == 2
    assert rec.requests == []
    assert "--quota-token-period" in capsys.readouterr().err
