"""M8 limits and M9 idempotency keys through a real gateway, with the real OpenAI SDK.

One uvicorn loop serves a fake engine and a GatewayApp with the in-memory store and a
FakeClock (time only moves when a test moves it). Every test gets its own API key and
endpoint id, so limit state never leaks between tests. The endpoint API tests at the end
run on SQLite and PostgreSQL.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.core.clock import FakeClock
from heteroflow.gateway.app import GatewayApp
from heteroflow.gateway.routing.store import MemoryStore
from heteroflow.schemas.routing import (
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread

from .conftest import Api, service_body

TENANT = "tenant-limits"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
_ids = itertools.count(1)


@dataclass
class Env:
    thread: UvicornThread
    holder: SnapshotHolder
    clock: FakeClock
    port: int
    engine: FakeOpenAIBackend
    engine_url: str
    clients: list[openai.OpenAI] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def key(self, **limits: Any) -> str:
        """Publish a snapshot with one new key (its own endpoint) and return the key."""
        n = next(_ids)
        key = f"sk-limits-{n}"
        entry = KeyEntry(f"ep-limits-{n}", TENANT, None, frozenset({"chat-model"}), **limits)
        target = RouteTarget("r", "g", 0, 1, (Backend("t", self.engine_url),))
        self.holder.publish(
            RoutingSnapshot(
                version=n, keys={hash_key(key): entry}, routes={(TENANT, "chat-model"): (target,)}
            )
        )
        return key

    def client(self, key: str) -> openai.OpenAI:
        c = openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=10.0)
        self.clients.append(c)
        return c


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    engine = FakeOpenAIBackend(["engine-x"], name="x")
    engine_url = f"http://127.0.0.1:{thread.serve(engine)}"
    holder = SnapshotHolder()
    clock = FakeClock(datetime(2026, 5, 31, 23, 0, tzinfo=UTC))
    gateway = GatewayApp(holder, store=MemoryStore(), clock=clock)
    port = thread.serve(gateway)
    try:
        yield Env(thread, holder, clock, port, engine, engine_url)
    finally:
        thread.call(gateway.aclose())
        thread.stop()


@pytest.fixture
def gw(env: Env) -> Iterator[Env]:
    yield env
    while env.clients:
        env.clients.pop().close()


def _chat(c: openai.OpenAI, **kw: Any) -> Any:
    return c.chat.completions.with_raw_response.create(model="chat-model", messages=MSG, **kw)


# --- M8 limits ---------------------------------------------------------------------------


@pytest.mark.feature("M8")
@pytest.mark.feature("M12")
def test_rpm_answers_openai_429_with_retry_after_and_headers(gw: Env) -> None:
    c = gw.client(gw.key(rpm_limit=2))
    first = _chat(c)
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert first.headers["x-ratelimit-remaining-requests"] == "1"
    assert first.headers["x-ratelimit-reset-requests"] == "30s"
    assert "x-ratelimit-limit-tokens" not in first.headers  # no TPM on this key
    assert first.parse().choices[0].message.content == "tok tok tok"
    assert _chat(c).headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError) as exc:
        _chat(c)
    err = exc.value
    assert err.code == "rate_limit_exceeded" and err.type == "requests"
    assert err.response.headers["retry-after"] == "30"
    assert err.response.headers["retry-after-ms"] == "30000"
    assert err.response.headers["x-ratelimit-remaining-requests"] == "0"
    gw.clock.advance(30)
    assert _chat(c).headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.feature("M8")
def test_tpm_reserves_then_reconciles_with_the_real_usage(gw: Env) -> None:
    c = gw.client(gw.key(tpm_limit=200))
    # The fake engine reports 1 prompt + 3 completion tokens: 4 real tokens.
    r1 = int(_chat(c, max_tokens=40).headers["x-ratelimit-remaining-tokens"])
    reserved = 200 - r1
    assert reserved > 40  # max_tokens + the prompt estimate
    r2 = int(_chat(c, max_tokens=40).headers["x-ratelimit-remaining-tokens"])
    assert r2 == 200 - 4 - reserved  # the first reservation was corrected to 4
    with pytest.raises(openai.RateLimitError) as exc:
        _chat(c, max_tokens=195)  # reserve (capped at 200) > the 192 left
    assert exc.value.code == "rate_limit_exceeded" and exc.value.type == "tokens"
    assert int(exc.value.response.headers["retry-after-ms"]) > 0


@pytest.mark.feature("M8")
def test_tpm_reconciles_streams_from_their_usage_event(gw: Env) -> None:
    c = gw.client(gw.key(tpm_limit=500))

    def stream() -> int:
        raw = c.chat.completions.with_raw_response.create(
            model="chat-model", messages=MSG, max_tokens=50, stream=True
        )
        text = "".join(ch.choices[0].delta.content or "" for ch in raw.parse() if ch.choices)
        assert text == "tok tok tok"
        return int(raw.headers["x-ratelimit-remaining-tokens"])

    r1 = stream()
    assert stream() == r1 - 4  # 1 prompt + 3 completion tokens from the usage event


@pytest.mark.feature("M8")
@pytest.mark.feature("M12")
def test_quota_breaker_answers_insufficient_quota_until_the_utc_day_ends(gw: Env) -> None:
    c = gw.client(gw.key(quota_tokens=10, quota_period="day"))
    for _ in range(3):  # 4 real tokens each: 0 -> 4 -> 8 -> 12 (passes while below 10)
        assert "x-ratelimit-limit-requests" not in _chat(c, max_tokens=5).headers
    with pytest.raises(openai.RateLimitError) as exc:
        _chat(c, max_tokens=5)
    err = exc.value
    assert err.code == "insufficient_quota" and err.type == "insufficient_quota"
    assert int(err.response.headers["retry-after"]) <= 3600  # the clock is before 24:00
    gw.clock.advance(3600)
    assert _chat(c, max_tokens=5).parse().choices[0].message.content == "tok tok tok"


@pytest.mark.feature("M8")
def test_keys_without_limits_get_no_ratelimit_headers(gw: Env) -> None:
    raw = _chat(gw.client(gw.key()))
    assert not [h for h in raw.headers if h.startswith("x-ratelimit")]


# --- M9 idempotency keys ----------------------------------------------------------------


def _idem(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


@pytest.mark.feature("M9")
def test_the_first_answer_is_replayed_and_the_engine_called_once(gw: Env) -> None:
    c = gw.client(gw.key())
    before = len(gw.engine.received)
    first = _chat(c, extra_headers=_idem("order-1"))
    again = _chat(c, extra_headers=_idem("order-1"))
    assert again.parse().id == first.parse().id
    assert again.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in first.headers
    assert len(gw.engine.received) == before + 1
    with pytest.raises(openai.UnprocessableEntityError) as exc:
        c.chat.completions.create(
            model="chat-model",
            messages=[{"role": "user", "content": "something else"}],
            extra_headers=_idem("order-1"),
        )
    assert exc.value.code == "idempotency_key_reused"
    # keys are scoped to the API key: another key may use the same value
    other = _chat(gw.client(gw.key()), extra_headers=_idem("order-1"))
    assert other.parse().id != first.parse().id


@pytest.mark.feature("M9")
def test_409_while_the_first_is_in_flight_then_the_replay(gw: Env) -> None:
    c = gw.client(gw.key())
    slow = {"fake_delay_ms": 600}
    done: dict[str, str] = {}

    def first() -> None:
        done["id"] = c.chat.completions.create(
            model="chat-model", messages=MSG, extra_body=slow, extra_headers=_idem("slow-1")
        ).id

    t = threading.Thread(target=first)
    received = len(gw.engine.received)
    t.start()
    try:
        deadline = time.monotonic() + 5.0
        while len(gw.engine.received) == received:  # the first reached the engine
            assert time.monotonic() < deadline
            time.sleep(0.005)
        with pytest.raises(openai.ConflictError) as exc:
            c.chat.completions.create(
                model="chat-model", messages=MSG, extra_body=slow, extra_headers=_idem("slow-1")
            )
        assert exc.value.code == "idempotency_key_in_use"
        assert exc.value.response.headers["retry-after"] == "1"
    finally:
        t.join(10)
    replay = c.chat.completions.create(
        model="chat-model", messages=MSG, extra_body=slow, extra_headers=_idem("slow-1")
    )
    assert replay.id == done["id"]


@pytest.mark.feature("M9")
def test_streams_are_recorded_and_replayed_as_a_stream(gw: Env) -> None:
    c = gw.client(gw.key())
    before = len(gw.engine.received)

    def run() -> tuple[list[str], str, str | None]:
        raw = c.chat.completions.with_raw_response.create(
            model="chat-model", messages=MSG, stream=True, extra_headers=_idem("s-1")
        )
        assert raw.headers["content-type"].startswith("text/event-stream")
        chunks = list(raw.parse())
        # The replay carries no usage event the client did not ask for, like the original.
        assert all(ch.usage is None for ch in chunks)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        return [ch.id for ch in chunks], text, raw.headers.get("idempotent-replayed")

    ids, text, replayed = run()
    assert text == "tok tok tok" and replayed is None
    assert run() == (ids, text, "true")
    assert len(gw.engine.received) == before + 1


@pytest.mark.feature("M9")
def test_failed_answers_are_not_stored_so_a_retry_runs_again(gw: Env) -> None:
    c = gw.client(gw.key())
    before = len(gw.engine.received)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError):
            c.chat.completions.create(
                model="chat-model",
                messages=MSG,
                extra_body={"fake_status": 500},
                extra_headers=_idem("fails"),
            )
    assert len(gw.engine.received) == before + 2


@pytest.mark.feature("M8")
@pytest.mark.feature("M9")
def test_replays_cost_no_rate_limit_and_a_429_is_not_stored(gw: Env) -> None:
    c = gw.client(gw.key(rpm_limit=1))
    first = _chat(c, extra_headers=_idem("a"))
    replay = _chat(c, extra_headers=_idem("a"))  # RPM is spent, the replay still answers
    assert replay.parse().id == first.parse().id
    with pytest.raises(openai.RateLimitError):
        _chat(c, extra_headers=_idem("b"))
    gw.clock.advance(60)
    later = _chat(c, extra_headers=_idem("b"))  # not a replay of the 429
    assert "idempotent-replayed" not in later.headers


@pytest.mark.feature("M9")
def test_an_overlong_idempotency_key_is_a_400(gw: Env) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        gw.client(gw.key()).chat.completions.create(
            model="chat-model", messages=MSG, extra_headers=_idem("k" * 256)
        )
    assert exc.value.code == "invalid_idempotency_key"


# --- the endpoint API (SQLite and PostgreSQL) --------------------------------------------


@pytest.mark.feature("M8")
def test_limits_are_set_on_the_endpoint_and_reach_the_snapshot(api: Api) -> None:
    admin = api.login()
    member = api.member(admin, "team-l", "lena")
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=member).json()
    url = f"/api/v1/gateway/endpoints/{g['endpoint']}"
    body = {"rpm_limit": 60, "tpm_limit": 10000, "quota_tokens": 500000, "quota_period": "month"}
    r = api.client.patch(url, json=body, headers=member)
    assert r.status_code == 200, r.text
    assert {k: r.json()[k] for k in body} == body
    listed = api.client.get("/api/v1/gateway/endpoints", headers=member).json()[0]
    assert {k: listed[k] for k in body} == body
    entry = api.app.publisher.refresh().keys[hash_key(g["api_key"])]
    assert (entry.rpm_limit, entry.tpm_limit, entry.quota_tokens, entry.quota_period) == (
        60,
        10000,
        500000,
        "month",
    )
    # 0 clears a limit; the others stay
    r = api.client.patch(url, json={"rpm_limit": 0}, headers=member)
    assert (r.json()["rpm_limit"], r.json()["tpm_limit"]) == (0, 10000)
    other = api.member(admin, "team-o", "omar")
    assert api.client.patch(url, json={"rpm_limit": 1}, headers=other).status_code == 404


@pytest.mark.feature("M8")
@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"rpm_limit": -1}, "rpm_limit"),
        ({"tpm_limit": "lots"}, "tpm_limit"),
        ({"quota_period": "week"}, "quota_period"),
        ({"quota_tokens": 100}, "quota_period"),  # a quota needs its period
        ({"rpm": 10}, "rpm"),
    ],
)
def test_limit_validation_names_the_field(api: Api, body: dict[str, Any], field: str) -> None:
    admin = api.login()
    g = api.client.post("/api/v1/task-groups", json=service_body(), headers=admin).json()
    r = api.client.patch(f"/api/v1/gateway/endpoints/{g['endpoint']}", json=body, headers=admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
