"""Engine load from a backend's Prometheus ``/metrics`` text (M2 ``engine_aware``): pure.

Three engines, three spellings of the same three gauges (running, waiting, KV use 0..1):

* vLLM: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` before 0.10; a ratio
  despite the name);
* SGLang: ``sglang:num_running_reqs``, ``sglang:num_queue_reqs``, ``sglang:token_usage``;
* llama.cpp: ``llamacpp:requests_processing``, ``llamacpp:requests_deferred``,
  ``llamacpp:kv_cache_usage_ratio``.

Series of one gauge (vLLM's ``engine`` label under data parallelism, SGLang's ``dp_rank``)
are summed for the request counts; KV use is the fullest series. Current llama.cpp
servers no longer export ``kv_cache_usage_ratio`` (checked against the xllamacpp build
in the venv), so KV use may be unknown and then counts as 0.

Score (lower is better), in "running requests" units::

    max(0, running + in_flight_now - in_flight_at_scrape)
        + WAITING_WEIGHT * waiting + KV_WEIGHT * kv_use

A queued request means the engine is already saturated, hence its weight; a full KV
cache is about to preempt, so it counts like ``KV_WEIGHT`` more running requests. The
in-flight delta adds what this gateway sent (or saw finish) since the scrape, so a burst
between two scrapes does not all land on the backend that looked idle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WAITING_WEIGHT = 4.0
KV_WEIGHT = 8.0

_RUNNING = frozenset(
    {"vllm:num_requests_running", "sglang:num_running_reqs", "llamacpp:requests_processing"}
)
_WAITING = frozenset(
    {"vllm:num_requests_waiting", "sglang:num_queue_reqs", "llamacpp:requests_deferred"}
)
_KV = frozenset(
    {
        "vllm:kv_cache_usage_perc",
        "vllm:gpu_cache_usage_perc",
        "sglang:token_usage",
        "llamacpp:kv_cache_usage_ratio",
    }
)

# issue 33: vLLM's prefix-cache counters (tokens; llama.cpp and SGLang export none)
_PREFIX_HITS = "vllm:prefix_cache_hits_total"
_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of one backend."""

    running: float
    waiting: float
    kv_use: float | None  # 0..1; None when the engine does not export it
    # this gateway's in-flight requests to the backend when the scrape was taken
    in_flight_at_scrape: int = 0
    # issue 33: prefix-cache counters (tokens) since the engine started, where it exports
    # them (vLLM's prefix_cache_hits_total / _queries_total); None: not reported
    prefix_hits: float | None = None
    prefix_queries: float | None = None


def parse_engine_metrics(text: str) -> EngineLoad | None:
    """The load in a ``/metrics`` page, or None when it has no running/waiting gauge."""
    running: float | None = None
    waiting: float | None = None
    kv: float | None = None
    hits: float | None = None
    queries: float | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if space < 0:
            continue
        end = brace if 0 <= brace < space else space
        name = line[:end]
        if name in _RUNNING:
            kind = 0
        elif name in _WAITING:
            kind = 1
        elif name in _KV:
            kind = 2
        elif name == _PREFIX_HITS:
            kind = 3
        elif name == _PREFIX_QUERIES:
            kind = 4
        else:
            continue
        value = _sample_value(line, brace if end == brace else -1)
        if value is None:
            continue
        if kind == 0:
            running = value if running is None else running + value
        elif kind == 1:
            waiting = value if waiting is None else waiting + value
        elif kind == 3:
            hits = value if hits is None else hits + value
        elif kind == 4:
            queries = value if queries is None else queries + value
        else:
            kv = value if kv is None else max(kv, value)
    if running is None and waiting is None:
        return None
    return EngineLoad(
        running=running or 0.0,
        waiting=waiting or 0.0,
        kv_use=None if kv is None else min(max(kv, 0.0), 1.0),
        prefix_hits=hits,
        prefix_queries=queries,
    )


def engine_score(load: EngineLoad, in_flight_now: int) -> float:
    """Lower is better; see the module docstring."""
    running = max(0.0, load.running + in_flight_now - load.in_flight_at_scrape)
    return running + WAITING_WEIGHT * load.waiting + KV_WEIGHT * (load.kv_use or 0.0)


def _sample_value(line: str, brace: int) -> float | None:
    """The value of one sample line (labels may hold spaces and braces inside quotes)."""
    rest = line
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        rest = line[close + 1 :]
    else:
        rest = line[line.find(" ") :]
    parts = rest.split()
    if not parts:
        return None
    try:
        value = float(parts[0])
    except ValueError:
        return None
    if math.isnan(value) or math.isinf(value) or value < 0:
        return None
    return value
