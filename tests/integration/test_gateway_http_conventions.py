"""HTTP conventions end to end (issue 15, item 6): a real uvicorn gateway, a fake engine,
the OpenAI SDK and httpx — x-request-id on every answer (and upstream), CORS,
stream headers, gzip/deflate request bodies."""

from __future__ import annotations

import gzip
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.gateway.inbound import MAX_BODY_BYTES
from heteroflow.schemas.routing import SnapshotHolder
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from tests.gateway_stack import RequestIdTap, serve_gateway, snapshot, target

KEY = "sk-http-conventions-0001"
ORIGIN = "https://app.example"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]
CHAT = {"model": "chat", "messages": MSG}


@dataclass
class Env:
    tap: RequestIdTap
    url: str  # CORS on for ORIGIN
    plain_url: str  # CORS off (the default)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=KEY, max_retries=0, timeout=10)


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    thread = UvicornThread()
    tap = RequestIdTap(FakeOpenAIBackend(["engine-h"], name="h"))
    url = f"http://127.0.0.1:{thread.serve(tap)}"
    holder = SnapshotHolder(snapshot({"chat": target("h", url)}, key=KEY))
    try:
        with (
            serve_gateway(holder, thread, cors_origins=[ORIGIN]) as cors,
            serve_gateway(holder, thread) as plain,
        ):
            yield Env(tap, cors.url, plain.url)
    finally:
        thread.stop()


def _auth(**more: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}", **more}


@pytest.mark.feature("M13")
def test_every_answer_has_a_request_id_the_sdk_and_the_engine_see(env: Env) -> None:
    with env.client() as client:
        done = client.chat.completions.create(model="chat", messages=MSG)
        assert done._request_id is not None and done._request_id.startswith("req_")
        assert env.tap.request_ids[-1] == done._request_id  # forwarded upstream
        raw = client.chat.completions.with_raw_response.create(
            model="chat", messages=MSG, extra_headers={"X-Request-Id": "my-trace-7"}
        )
        assert raw.headers["x-request-id"] == "my-trace-7"  # the caller's own, kept
        assert env.tap.request_ids[-1] == "my-trace-7"
        assert client.models.with_raw_response.list().headers["x-request-id"].startswith("req_")
        with pytest.raises(openai.NotFoundError) as missing:
            client.chat.completions.create(model="nope", messages=MSG)
        assert missing.value.request_id is not None
    bad = httpx.post(f"{env.url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "a\tb"})
    assert bad.status_code == 401 and bad.headers["x-request-id"].startswith("req_")
    assert httpx.get(f"{env.url}/v1/nowhere").headers["x-request-id"].startswith("req_")


@pytest.mark.feature("M13")
def test_streams_are_not_cached_or_buffered(env: Env) -> None:
    with httpx.stream(
        "POST", f"{env.url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=_auth()
    ) as r:
        r.read()
    assert r.status_code == 200
    assert r.headers["cache-control"] == "no-cache"
    assert r.headers["x-accel-buffering"] == "no"
    assert r.headers["x-request-id"].startswith("req_")


@pytest.mark.feature("M13")
@pytest.mark.parametrize(
    ("encoding", "pack"),
    [("gzip", gzip.compress), ("deflate", zlib.compress)],
)
def test_compressed_request_bodies_are_accepted(env: Env, encoding: str, pack: object) -> None:
    assert callable(pack)
    body = pack(orjson.dumps({**CHAT, "fake_chunks": 2}))
    r = httpx.post(
        f"{env.url}/v1/chat/completions",
        content=body,
        headers=_auth(**{"Content-Encoding": encoding, "Content-Type": "application/json"}),
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "tok tok"


@pytest.mark.feature("M13")
def test_bad_encodings_and_bombs_are_client_errors(env: Env) -> None:
    url = f"{env.url}/v1/chat/completions"
    r = httpx.post(url, content=b"xx", headers=_auth(**{"Content-Encoding": "br"}))
    assert r.status_code == 415 and "Content-Encoding 'br'" in r.json()["error"]["message"]
    bomb = gzip.compress(b" " * (MAX_BODY_BYTES + 1), compresslevel=1)  # ~64 KiB on the wire
    r = httpx.post(url, content=bomb, headers=_auth(**{"Content-Encoding": "gzip"}))
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.feature("M13")
def test_cors_preflight_and_answers_for_an_allowed_origin(env: Env) -> None:
    asks = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os",
    }
    pre = httpx.options(f"{env.url}/v1/chat/completions", headers=asks)
    assert pre.status_code == 204
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    assert pre.headers["access-control-allow-headers"] == asks["Access-Control-Request-Headers"]
    assert int(pre.headers["access-control-max-age"]) > 0
    r = httpx.post(f"{env.url}/v1/chat/completions", json=CHAT, headers=_auth(Origin=ORIGIN))
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"]
    assert r.headers["vary"] == "Origin"
    # an origin not in the list: no allow-origin (the browser blocks the page)
    other = httpx.options(
        f"{env.url}/v1/chat/completions", headers={**asks, "Origin": "https://evil.example"}
    )
    assert other.status_code == 204 and "access-control-allow-origin" not in other.headers


@pytest.mark.feature("M13")
def test_without_cors_options_is_allowed_but_grants_no_origin(env: Env) -> None:
    asks = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    pre = httpx.options(f"{env.plain_url}/v1/chat/completions", headers=asks)
    assert pre.status_code == 204 and pre.headers["allow"] == "POST, OPTIONS"
    assert not [h for h in pre.headers if h.startswith("access-control-")]
    assert httpx.options(f"{env.plain_url}/v1/models").headers["allow"] == "GET, OPTIONS"
    assert httpx.options(f"{env.plain_url}/v1/nowhere").status_code == 404
    r = httpx.post(f"{env.plain_url}/v1/chat/completions", json=CHAT, headers=_auth(Origin=ORIGIN))
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
