"""The gateway's Prometheus metrics (P3), kept in plain dicts and rendered by hand.

Counting is a dict update (no client library, no locks: the gateway is one event loop);
the text exposition format is built only when ``/metrics`` is scraped. Every request the
gateway answers except the scrapes themselves is counted, whatever its outcome (401 bad
or missing key, 400, 404, 405, 429, 5xx, 2xx) and path. Labels stay bounded: the path
label is one of the gateway's routes (``/v1/models/{model}`` for any model id, ``other``
for a path it does not serve, see :func:`path_label`), the model label is a routed model
name ("" when the request named no route, so callers cannot grow the series with
made-up names), the backend label one of the snapshot's base URLs; keys and tenants are
never labels.

Series:
  heteroflow_gateway_requests_total{path,model,status}   counter (status 499: the client
                                                           left before any answer)
  heteroflow_gateway_in_flight                           gauge
  heteroflow_gateway_upstream_latency_seconds{model}     histogram, request sent to the
                                                           backend's response headers
  heteroflow_gateway_tokens_total{model,kind}            counter, kind prompt|completion
  heteroflow_gateway_ejections_total{backend}            counter (passive health, M5)
  heteroflow_gateway_failovers_total{backend}            counter: requests sent on to
                                                           another backend after this
                                                           one provably did not answer
  heteroflow_gateway_held_requests{model}                gauge: requests held now for a
                                                           sleeping model to wake (F6)
                                                           or a starting one to come up
                                                           (M17; a model's series
                                                           appears at its first hold)
  heteroflow_gateway_wake_holds_total{model,outcome}     counter, outcome ready | timeout
                                                           | refused | failed | not_held
                                                           | client_left
  heteroflow_gateway_wake_hold_seconds{model}            histogram: arrival to ready
  heteroflow_gateway_start_holds_total{model,outcome}    counter (M17), the same outcomes
  heteroflow_gateway_start_hold_seconds{model}           histogram: arrival to ready
  heteroflow_gateway_wakes_total{model,branch}           counter: the server's answer per
                                                           task (waking, already_running,
                                                           starting, node_offline,
                                                           card_borrowed, container_gone,
                                                           failed, other; error: not asked)
  heteroflow_gateway_fair_queued{model}                  gauge (M16): requests waiting now
                                                           for a slot of their saturated
                                                           pool, in their tenant's queue
  heteroflow_gateway_fair_wait_seconds{model}            histogram: queued to given a slot
  heteroflow_gateway_fair_refusals_total{model,reason}   counter, reason queue_full (429)
                                                           | wait_timeout (503) | client_left
"""

from __future__ import annotations

from heteroflow.core.prometheus import Histogram

DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CLIENT_LEFT = 499
# The path label: the routes the gateway serves, by their own name...
ROUTE_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/responses"}
)
# The wake branches and hold outcomes a label may take; anything else is "other".
WAKE_BRANCHES = frozenset(
    {
        "waking", "already_running", "starting", "node_offline", "card_borrowed",
        "container_gone", "failed", "error",
    }
)
HOLD_OUTCOMES = frozenset({"ready", "timeout", "refused", "failed", "not_held", "client_left"})
MODEL_ROUTE = "/v1/models/{model}"  # ...one label for every model id asked for...
OTHER_PATH = "other"  # ...and one for every path it does not serve (answered 404)


def path_label(path: str) -> str:
    """The bounded ``path`` label of a request to ``path``."""
    if path in ROUTE_PATHS:
        return path
    if path.startswith("/v1/models/"):
        return MODEL_ROUTE
    return OTHER_PATH


class GatewayMetrics:
    def __init__(self, buckets: tuple[float, ...] = DEFAULT_BUCKETS) -> None:
        self._buckets = buckets
        self.requests: dict[tuple[str, str, int], int] = {}
        self.in_flight = 0
        self.latency: dict[str, Histogram] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        self.ejections: dict[str, int] = {}
        self.failovers: dict[str, int] = {}
        self.held: dict[str, int] = {}  # model -> requests held for it now (F6, M17)
        self.holds: dict[tuple[str, str], int] = {}  # a sleeping model's (F6)
        self.hold_seconds: dict[str, Histogram] = {}
        self.start_holds: dict[tuple[str, str], int] = {}  # a starting model's (M17)
        self.start_hold_seconds: dict[str, Histogram] = {}
        self.wakes: dict[tuple[str, str], int] = {}
        # M16 fair share (gateway.routing.fair_gate)
        self.fair_queue: dict[str, int] = {}  # model -> requests queued now
        self.fair_waits: dict[str, Histogram] = {}
        self.fair_refusals: dict[tuple[str, str], int] = {}  # (model, reason)

    def request_done(self, path: str, model: str, status: int) -> None:
        key = (path, model, status or CLIENT_LEFT)
        self.requests[key] = self.requests.get(key, 0) + 1

    def upstream_latency(self, model: str, seconds: float) -> None:
        h = self.latency.get(model)
        if h is None:
            h = self.latency[model] = Histogram(self._buckets)
        h.observe(seconds)

    def tokens_used(self, model: str, prompt: int, completion: int) -> None:
        for kind, n in (("prompt", prompt), ("completion", completion)):
            key = (model, kind)
            self.tokens[key] = self.tokens.get(key, 0) + n

    def ejected(self, backend: str) -> None:
        self.ejections[backend] = self.ejections.get(backend, 0) + 1

    def failed_over(self, backend: str) -> None:
        self.failovers[backend] = self.failovers.get(backend, 0) + 1

    def hold_started(self, model: str) -> None:
        self.held[model] = self.held.get(model, 0) + 1

    def hold_ended(self, model: str) -> None:
        self.held[model] -= 1

    def hold_done(
        self, model: str, outcome: str, ready_after_s: float | None, *, starting: bool = False
    ) -> None:
        """A hold ended: for a sleeping model (F6), or a ``starting`` one (M17)."""
        holds, seconds = (
            (self.start_holds, self.start_hold_seconds)
            if starting
            else (self.holds, self.hold_seconds)
        )
        key = (model, outcome if outcome in HOLD_OUTCOMES else "other")
        holds[key] = holds.get(key, 0) + 1
        if ready_after_s is not None:
            h = seconds.get(model)
            if h is None:
                h = seconds[model] = Histogram(self._buckets)
            h.observe(ready_after_s)

    def woken(self, model: str, branch: str) -> None:
        key = (model, branch if branch in WAKE_BRANCHES else "other")
        self.wakes[key] = self.wakes.get(key, 0) + 1

    def fair_queued(self, model: str, delta: int) -> None:
        self.fair_queue[model] = self.fair_queue.get(model, 0) + delta

    def fair_waited(self, model: str, seconds: float) -> None:
        h = self.fair_waits.get(model)
        if h is None:
            h = self.fair_waits[model] = Histogram(self._buckets)
        h.observe(seconds)

    def fair_refused(self, model: str, reason: str) -> None:
        key = (model, reason)
        self.fair_refusals[key] = self.fair_refusals.get(key, 0) + 1

    def render(self) -> bytes:
        out: list[str] = [
            "# HELP heteroflow_gateway_requests_total Requests answered, by path, model and "
            "status.",
            "# TYPE heteroflow_gateway_requests_total counter",
        ]
        for (path, model, status), n in sorted(self.requests.items()):
            out.append(
                "heteroflow_gateway_requests_total"
                f'{{path="{_esc(path)}",model="{_esc(model)}",status="{status}"}} {n}'
            )
        out += [
            "# HELP heteroflow_gateway_in_flight Requests being answered now.",
            "# TYPE heteroflow_gateway_in_flight gauge",
            f"heteroflow_gateway_in_flight {self.in_flight}",
            "# HELP heteroflow_gateway_upstream_latency_seconds Time from sending a request "
            "to a backend to its response headers.",
            "# TYPE heteroflow_gateway_upstream_latency_seconds histogram",
        ]
        _histograms(out, "heteroflow_gateway_upstream_latency_seconds", self.latency)
        out += [
            "# HELP heteroflow_gateway_tokens_total Tokens reported by backends' usage.",
            "# TYPE heteroflow_gateway_tokens_total counter",
        ]
        for (model, kind), n in sorted(self.tokens.items()):
            label = f'model="{_esc(model)}",kind="{kind}"'
            out.append(f"heteroflow_gateway_tokens_total{{{label}}} {n}")
        out += [
            "# HELP heteroflow_gateway_ejections_total Backends taken out of routing after "
            "a failure.",
            "# TYPE heteroflow_gateway_ejections_total counter",
        ]
        for backend, n in sorted(self.ejections.items()):
            out.append(f'heteroflow_gateway_ejections_total{{backend="{_esc(backend)}"}} {n}')
        out += [
            "# HELP heteroflow_gateway_failovers_total Requests sent on to another backend "
            "after this one provably did not answer (no connection, or closed before any answer).",
            "# TYPE heteroflow_gateway_failovers_total counter",
        ]
        for backend, n in sorted(self.failovers.items()):
            out.append(f'heteroflow_gateway_failovers_total{{backend="{_esc(backend)}"}} {n}')
        out += [
            "# HELP heteroflow_gateway_held_requests Requests held while their sleeping "
            "model wakes up or its starting replicas come up.",
            "# TYPE heteroflow_gateway_held_requests gauge",
            *(
                f'heteroflow_gateway_held_requests{{model="{_esc(model)}"}} {n}'
                for model, n in sorted(self.held.items())
            ),
            "# HELP heteroflow_gateway_wake_holds_total Requests that found their model "
            "asleep, by how their hold ended.",
            "# TYPE heteroflow_gateway_wake_holds_total counter",
        ]
        for (model, outcome), n in sorted(self.holds.items()):
            label = f'model="{_esc(model)}",outcome="{outcome}"'
            out.append(f"heteroflow_gateway_wake_holds_total{{{label}}} {n}")
        out += [
            "# HELP heteroflow_gateway_wake_hold_seconds Time a request was held until "
            "its model was awake.",
            "# TYPE heteroflow_gateway_wake_hold_seconds histogram",
        ]
        _histograms(out, "heteroflow_gateway_wake_hold_seconds", self.hold_seconds)
        out += [
            "# HELP heteroflow_gateway_start_holds_total Requests that found their model's "
            "replicas starting, by how their hold ended.",
            "# TYPE heteroflow_gateway_start_holds_total counter",
        ]
        for (model, outcome), n in sorted(self.start_holds.items()):
            label = f'model="{_esc(model)}",outcome="{outcome}"'
            out.append(f"heteroflow_gateway_start_holds_total{{{label}}} {n}")
        out += [
            "# HELP heteroflow_gateway_start_hold_seconds Time a request was held until "
            "a starting replica of its model was up.",
            "# TYPE heteroflow_gateway_start_hold_seconds histogram",
        ]
        _histograms(out, "heteroflow_gateway_start_hold_seconds", self.start_hold_seconds)
        out += [
            "# HELP heteroflow_gateway_wakes_total Wakes asked for by requests, by the "
            "server's answer per task.",
            "# TYPE heteroflow_gateway_wakes_total counter",
        ]
        for (model, branch), n in sorted(self.wakes.items()):
            label = f'model="{_esc(model)}",branch="{branch}"'
            out.append(f"heteroflow_gateway_wakes_total{{{label}}} {n}")
        out += [
            "# HELP heteroflow_gateway_fair_queued Requests waiting for a slot of their "
            "saturated pool (fair share).",
            "# TYPE heteroflow_gateway_fair_queued gauge",
            *(
                f'heteroflow_gateway_fair_queued{{model="{_esc(model)}"}} {n}'
                for model, n in sorted(self.fair_queue.items())
            ),
            "# HELP heteroflow_gateway_fair_wait_seconds Time a request waited for a slot "
            "of its saturated pool.",
            "# TYPE heteroflow_gateway_fair_wait_seconds histogram",
        ]
        _histograms(out, "heteroflow_gateway_fair_wait_seconds", self.fair_waits)
        out += [
            "# HELP heteroflow_gateway_fair_refusals_total Requests of a saturated pool "
            "answered without a slot, by reason.",
            "# TYPE heteroflow_gateway_fair_refusals_total counter",
        ]
        for (model, reason), n in sorted(self.fair_refusals.items()):
            label = f'model="{_esc(model)}",reason="{_esc(reason)}"'
            out.append(f"heteroflow_gateway_fair_refusals_total{{{label}}} {n}")
        return ("\n".join(out) + "\n").encode()


def _histograms(out: list[str], name: str, series: dict[str, Histogram]) -> None:
    for model, h in sorted(series.items()):
        label = f'model="{_esc(model)}"'
        cumulative = 0
        for bound, n in zip(h.bounds, h.counts, strict=False):
            cumulative += n
            out.append(f'{name}_bucket{{{label},le="{bound}"}} {cumulative}')
        out.append(f'{name}_bucket{{{label},le="+Inf"}} {h.count}')
        out.append(f"{name}_sum{{{label}}} {h.sum}")
        out.append(f"{name}_count{{{label}}} {h.count}")


def _esc(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
