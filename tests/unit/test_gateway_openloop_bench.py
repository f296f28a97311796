"""bench/gateway_openloop.py's last JSON line: what a proxy adds is its latency minus the
direct call's at the same rate in the same run, every fraction has its keys, and errors
are every open-loop cell's (capacity runs are not points)."""

from __future__ import annotations

from typing import Any

from .bench_module import load_bench

ol = load_bench("gateway_openloop")


def cell(
    target: str, mode: str, pct: int, p50: float, p99: float, errors: int = 0
) -> dict[str, Any]:
    lat = {"p50": p50, "p90": p99, "p99": p99, "p999": p99, "max": p99 + 1}
    return {
        "target": target, "cell": f"{mode}/{pct}pct", "pct": pct, "lat_ms": lat,
        "errors": errors, "rps": 100.0 * pct, "gw_cpu_ms_per_req": 0.25,
    }  # fmt: skip


def test_added_latency_is_the_same_cells_difference_and_errors_count_every_point() -> None:
    results = [
        {"target": "nginx", "cell": "capacity/nonstream", "errors": 7, "lat_ms": {}},
        cell("direct", "nonstream", 50, 1.0, 4.0),
        cell("nginx", "nonstream", 50, 1.2, 5.0),
        cell("heteroflow", "nonstream", 50, 1.5, 5.5, errors=2),
        cell("direct", "nonstream", 80, 2.0, 9.0),
        cell("nginx", "nonstream", 80, 2.5, 12.0),
        cell("heteroflow", "nonstream", 80, 9.0, 40.0),
        cell("direct", "stream", 50, 3.0, 6.0),
        cell("nginx", "stream", 50, 3.5, 7.0, errors=1),
        cell("heteroflow", "stream", 50, 4.0, 9.0),
    ]
    rates = {"nonstream": {50: 5000.0, 80: 8000.0}, "stream": {50: 1000.0}}
    caps = {
        "nginx": {"nonstream": 10000.0, "stream": 2000.0},
        "heteroflow": {"nonstream": 4000.0, "stream": 900.0},
    }
    out = ol.summarize(results, "nginx", caps, rates)
    assert out["added_p50_ms_at_50pct"] == 0.5
    assert out["added_p99_ms_at_50pct"] == 1.5
    assert out["added_p99_ms_at_80pct"] == 31.0
    assert out["nginx_added_p99_ms_at_50pct"] == 1.0
    assert out["nginx_added_p99_ms_at_80pct"] == 3.0
    assert out["stream_added_p99_ms_at_50pct"] == 3.0
    assert out["stream_nginx_added_p99_ms_at_50pct"] == 1.0
    assert out["errors"] == 3  # the capacity run's 7 are not a point's
    assert out["errors_by_target"] == {"direct": 0, "nginx": 1, "heteroflow": 2}
    assert out["rates_rps"] == {"50": 5000.0, "80": 8000.0}
    assert out["nginx_capacity_rps"] == 10000.0 and out["gateway_capacity_rps"] == 4000.0
    assert out["gateway_stream_capacity_rps"] == 900.0 and "direct_capacity_rps" not in out
