"""Engine load from /metrics text (M2 engine_aware): the three engines' names, the score."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.gateway.backend.engine_metrics import (
    KV_WEIGHT,
    WAITING_WEIGHT,
    EngineLoad,
    engine_score,
    parse_engine_metrics,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "engine_metrics"


def _text(name: str) -> str:
    return (DATA / name).read_text()


@pytest.mark.feature("M2")
def test_vllm_v1_sums_data_parallel_engines_and_takes_the_fullest_cache() -> None:
    load = parse_engine_metrics(_text("vllm.txt"))
    # running 5 + 2, waiting 3 + 0; the look-alike gauge and the histograms do not count
    assert load == EngineLoad(running=7.0, waiting=3.0, kv_use=0.62)


@pytest.mark.feature("M2")
def test_vllm_before_0_10_uses_gpu_cache_usage_perc_and_odd_labels_parse() -> None:
    assert parse_engine_metrics(_text("vllm_v0.txt")) == EngineLoad(4.0, 1.0, 0.25)


@pytest.mark.feature("M2")
def test_sglang_names() -> None:
    assert parse_engine_metrics(_text("sglang.txt")) == EngineLoad(17.0, 2826.0, 0.28)


@pytest.mark.feature("M2")
def test_llamacpp_capture_from_the_real_server() -> None:
    text = _text("llamacpp.txt")
    # Captured idle: both gauges present, no KV gauge in current llama.cpp.
    assert parse_engine_metrics(text) == EngineLoad(0.0, 0.0, None)
    busy = text.replace("llamacpp:requests_processing 0", "llamacpp:requests_processing 2")
    busy = busy.replace("llamacpp:requests_deferred 0", "llamacpp:requests_deferred 5")
    assert parse_engine_metrics(busy) == EngineLoad(2.0, 5.0, None)


@pytest.mark.feature("M2")
def test_older_llamacpp_kv_ratio_is_read() -> None:
    text = (
        "llamacpp:kv_cache_usage_ratio 0.75\n"
        "llamacpp:requests_processing 1\n"
        "llamacpp:requests_deferred 0\n"
    )
    assert parse_engine_metrics(text) == EngineLoad(1.0, 0.0, 0.75)


@pytest.mark.feature("M2")
@pytest.mark.parametrize(
    "text",
    [
        "",
        "# HELP only comments\n# TYPE x gauge\n",
        "process_cpu_seconds_total 12.5\n",
        "vllm:kv_cache_usage_perc 0.5\n",  # KV alone says nothing about requests
        'vllm:num_requests_running{engine="0"} NaN\nvllm:num_requests_waiting oops\n',
        "vllm:num_requests_running{broken 3\n",
    ],
)
def test_pages_without_a_usable_request_gauge_give_none(text: str) -> None:
    assert parse_engine_metrics(text) is None


@pytest.mark.feature("M2")
def test_bad_samples_are_skipped_and_kv_is_clamped() -> None:
    text = (
        "sglang:num_running_reqs 3\n"
        "sglang:num_running_reqs -1\n"  # nonsense: ignored, not subtracted
        "sglang:num_queue_reqs +Inf\n"
        "sglang:token_usage 1.7 1700000000000\n"  # with a timestamp
    )
    assert parse_engine_metrics(text) == EngineLoad(3.0, 0.0, 1.0)


@pytest.mark.feature("M2")
def test_score_weights_queue_and_cache_and_adds_the_in_flight_change() -> None:
    idle = EngineLoad(0.0, 0.0, 0.0)
    assert engine_score(idle, 0) == 0.0
    queued = EngineLoad(running=4.0, waiting=3.0, kv_use=0.95)
    busy_no_queue = EngineLoad(running=10.0, waiting=0.0, kv_use=0.3)
    assert engine_score(queued, 0) == 4.0 + 3 * WAITING_WEIGHT + 0.95 * KV_WEIGHT
    # a saturated engine (queueing, cache nearly full) scores worse than a busier one
    assert engine_score(busy_no_queue, 0) < engine_score(queued, 0)
    # two requests sent since the scrape (taken with 1 in flight) count as running
    scraped = EngineLoad(1.0, 0.0, None, in_flight_at_scrape=1)
    assert engine_score(scraped, 3) == 3.0
    # finished since the scrape: never below zero running
    assert engine_score(scraped, 0) == 0.0
    assert engine_score(EngineLoad(0.0, 0.0, None, in_flight_at_scrape=4), 0) == 0.0
