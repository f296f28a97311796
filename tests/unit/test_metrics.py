"""The gateway's Prometheus text: series, cumulative histogram buckets, label escaping."""

from __future__ import annotations

import re

import pytest

from heteroflow.gateway.metrics import GatewayMetrics

# name{labels} value — the sample line grammar of the text exposition format
_SAMPLE = re.compile(r'^[a-z_]+(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? [0-9.e+-]+$')


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.match(r"^# (HELP|TYPE) [a-z_]+ ", line), line
            continue
        assert _SAMPLE.match(line), line
        name, value = line.rsplit(" ", 1)
        out[name] = float(value)
    return out


@pytest.mark.feature("P3")
def test_counters_gauge_and_histogram() -> None:
    m = GatewayMetrics(buckets=(0.1, 1.0))
    m.request_done("/v1/chat/completions", "chat", 200)
    m.request_done("/v1/chat/completions", "chat", 200)
    m.request_done("/v1/chat/completions", "", 401)
    m.request_done("/v1/completions", "text", 0)  # the client left before any answer
    m.in_flight = 3
    for seconds in (0.05, 0.5, 0.5, 7.0):
        m.upstream_latency("chat", seconds)
    m.tokens_used("chat", 10, 4)
    m.tokens_used("chat", 1, 1)
    m.ejected("http://10.0.0.1:8000")
    s = _samples(m.render().decode())
    r = "heteroflow_gateway_requests_total"
    assert s[f'{r}{{path="/v1/chat/completions",model="chat",status="200"}}'] == 2
    assert s[f'{r}{{path="/v1/chat/completions",model="",status="401"}}'] == 1
    assert s[f'{r}{{path="/v1/completions",model="text",status="499"}}'] == 1
    assert s["heteroflow_gateway_in_flight"] == 3
    h = "heteroflow_gateway_upstream_latency_seconds"
    assert s[f'{h}_bucket{{model="chat",le="0.1"}}'] == 1
    assert s[f'{h}_bucket{{model="chat",le="1.0"}}'] == 3  # cumulative
    assert s[f'{h}_bucket{{model="chat",le="+Inf"}}'] == 4
    assert s[f'{h}_count{{model="chat"}}'] == 4
    assert s[f'{h}_sum{{model="chat"}}'] == pytest.approx(8.05)
    assert s['heteroflow_gateway_tokens_total{model="chat",kind="prompt"}'] == 11
    assert s['heteroflow_gateway_tokens_total{model="chat",kind="completion"}'] == 5
    assert s['heteroflow_gateway_ejections_total{backend="http://10.0.0.1:8000"}'] == 1


@pytest.mark.feature("P3")
def test_label_values_are_escaped() -> None:
    m = GatewayMetrics()
    m.request_done("/v1/completions", 'we"ird\\name\n', 200)
    text = m.render().decode()
    assert 'model="we\\"ird\\\\name\\n"' in text
    _samples(text)  # still one valid sample per line


@pytest.mark.feature("P3")
def test_empty_registry_renders_help_and_the_gauge() -> None:
    s = _samples(GatewayMetrics().render().decode())
    assert s == {"heteroflow_gateway_in_flight": 0}
