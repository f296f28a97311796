"""bench/gateway_workers.py's scaling figures: requests/s with N workers over the first
count of the list, from the same run, and nothing where a count was not measured."""

from __future__ import annotations

from .bench_module import load_bench

gw = load_bench("gateway_workers")


def test_scaling_is_each_counts_rate_over_the_first_ones() -> None:
    out = {"rps_req_w1": 6000.0, "rps_req_w2": 11400.0, "rps_req_w4": 21300.0}
    assert gw.scaling(out, [1, 2, 4, 8]) == {
        "scaling_w1": 1.0, "scaling_w2": 1.9, "scaling_w4": 3.55,
    }  # fmt: skip


def test_no_base_rate_gives_no_ratios() -> None:
    assert gw.scaling({"rps_req_w2": 11400.0}, [1, 2]) == {}
    assert gw.scaling({}, []) == {}
