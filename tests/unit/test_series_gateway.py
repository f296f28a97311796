"""The gateway's side of the live series (issue 33): answers, errors by kind and latency
percentiles per backend in the load report; vLLM's prefix-cache counters from a scrape;
the report's new fields over the wire."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.backend.engine_metrics import parse_engine_metrics
from heteroflow.gateway.policy.usage import TOKEN_WINDOW_S, UsageCollector
from heteroflow.schemas.usage import BackendLoad, BackendLoadIn, GatewayLoad, UsageRow


class _Sink:
    async def write(self, rows: Sequence[UsageRow]) -> None:
        pass

    async def write_report(self, activity: dict[str, datetime], load: GatewayLoad) -> None:
        pass


def test_answers_errors_and_percentiles_per_backend() -> None:
    clock = FakeClock()
    c = UsageCollector(_Sink(), clock)
    t = clock.monotonic()
    for k in range(20):  # 20 answers: 100..1,050 ms, the first bytes after 10..200 ms
        c.answers.done("task-a", 200, t, t + 0.01 * (k + 1), t + 0.05 * (k + 2))
    c.answers.done("task-a", 503, t, t + 0.01, t + 0.02)
    c.answers.done("task-a", 429, t, t + 0.01, t + 0.02)
    c.answers.done("task-a", 0, t, 0.0, t + 0.02)  # the client left before any byte
    assert c.answers.of("task-a") == {}  # nothing until the flush's roll
    clock.advance(1)
    c.roll_tokens()
    st = c.answers.of("task-a")
    assert st["answered"] == 23
    assert st["errors"] == {"5xx": 1, "429": 1, "client_left": 1}
    assert st["latency_ms"] == [550.0, 1000.0]  # errors are not in the percentiles
    assert st["ttft_ms"] == [100.0, 190.0]
    # the window moves on: the counters stay, the percentiles go
    clock.advance(TOKEN_WINDOW_S + 1)
    c.roll_tokens()
    st = c.answers.of("task-a")
    assert st["answered"] == 23 and st["latency_ms"] is None and st["ttft_ms"] is None


def test_prefix_cache_counters_from_vllm_and_none_from_llama_cpp() -> None:
    vllm = parse_engine_metrics(
        "vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n"
        'vllm:prefix_cache_queries_total{engine="0"} 1000\n'
        'vllm:prefix_cache_hits_total{engine="0"} 750\n'
    )
    assert vllm is not None
    assert (vllm.prefix_hits, vllm.prefix_queries) == (750.0, 1000.0)
    llama = parse_engine_metrics("llamacpp:requests_processing 1\nllamacpp:requests_deferred 0\n")
    assert llama is not None and llama.prefix_queries is None


def test_the_report_fields_go_over_the_wire_and_old_reports_still_parse() -> None:
    b = BackendLoad(
        "task-a", "tg-1", False, 2, 5.0, answered=7, errors={"5xx": 1},
        latency_ms=[10.0, 20.0], ttft_ms=[1.0, 2.0], prefix=(3.0, 4.0), ms_per_token=12.5,
    )
    assert BackendLoadIn.model_validate(b.to_wire()).to_load() == b
    old = {"task_id": "task-a", "group_id": "tg-1", "in_flight": 1}
    assert BackendLoadIn.model_validate(old).to_load().answered is None
    assert "answered" not in BackendLoad("task-a", "tg-1", False, 0, 0.0).to_wire()


def test_a_request_refused_before_a_backend_was_chosen_counts_on_its_service() -> None:
    from types import SimpleNamespace
    from typing import Any, cast

    from heteroflow.gateway.policy.answers import AnswerStats

    a = AnswerStats()
    target = SimpleNamespace(group_id="tg-1")
    no_backend = cast(Any, SimpleNamespace(backend=None, targets=(target,)))
    a.ended(no_backend, 503, 0.0, 0.0)  # no healthy backend
    a.ended(no_backend, 503, 0.0, 0.0)
    a.ended(cast(Any, SimpleNamespace(backend=None, targets=None)), 404, 0.0, 0.0)  # no route
    limited = cast(Any, SimpleNamespace(backend=SimpleNamespace(task_id="task-a"),
                                        targets=(target,)))
    a.ended(limited, 429, 0.0, 0.0)  # refused by a limit after the backend was chosen
    a.roll(1.0)
    assert a.refusals() == {"tg-1": {"5xx": 2}}
    assert a.of("task-a")["errors"] == {"429": 1}
    load = GatewayLoad("gw-1", (), a.refusals())
    wire = load.to_wire()
    assert wire["refused"] == {"tg-1": {"5xx": 2}}
    from heteroflow.schemas.usage import GatewayLoadIn

    assert GatewayLoadIn.model_validate(wire).to_load() == load
    assert "refused" not in GatewayLoad("gw-1").to_wire()
