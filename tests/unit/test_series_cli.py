"""``heteroflow services top``: the live series as sparklines (issue 33)."""

from __future__ import annotations

from heteroflow.cli import build_parser
from heteroflow.cmd.remote_series import render
from heteroflow.core.series import sparkline


def test_the_sparkline_scales_to_the_highest_and_shows_gaps() -> None:
    assert sparkline([None, 0, 1, 2, 3, 4, 5, 6, 7]) == " ▁▂▃▄▅▆▇█"
    assert sparkline([0.0, 0.0]) == "▁▁"
    assert len(sparkline([1.0] * 500, width=60)) == 60  # the last 60 only


def test_top_prints_a_line_per_metric_with_its_last_and_highest_value() -> None:
    answer = {
        "step": 10,
        "times": ["t1", "t2", "t3"],
        "values": {"requests_per_s": [None, 2.0, 4.0], "replicas": [1.0, 1.0, 2.0]},
        "events": [{"at": "2026-03-01T00:00:10Z", "kind": "group.scaled", "message": "1 → 2"}],
    }
    out = render(answer).splitlines()
    assert out[0] == "last 3 points, every 10 s (oldest left)"
    rate = next(line for line in out if line.startswith("requests_per_s"))
    assert " ▅█" in rate and "now 4 req/s" in rate and "max 4" in rate
    assert next(line for line in out if line.startswith("latency_p50_ms")).endswith("max —")
    assert out[-1] == "event 2026-03-01T00:00:10Z group.scaled: 1 → 2"


def test_the_verb_parses() -> None:
    a = build_parser().parse_args(["services", "top", "tg-123", "--since", "1h", "--json"])
    assert (a.action, a.id, a.since, a.json) == ("top", "tg-123", "1h", True)
