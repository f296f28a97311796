"""issue 33: operator commands on the database answer a bad argument in one line with
exit 2, never a traceback (the real entry point, a real SQLite database)."""

from __future__ import annotations

import pytest

from heteroflow import cli


def test_migrate_down_to_an_unknown_revision_is_one_line(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETEROFLOW_DATA_DIR", str(tmp_path))
    assert cli.main(["migrate"]) == 0
    capsys.readouterr()
    assert cli.main(["migrate", "--down-to", "bogus"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "heteroflow migrate: --down-to bogus: Can't locate revision identified by 'bogus'"
    ]
