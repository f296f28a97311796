"""One request id from the client through the gateway to the engine (P3).

A real gateway on uvicorn before a fake engine that notes the ``x-request-id`` of every
request, called with the OpenAI SDK: the engine gets the id the client sees (the
caller's own, or the gateway's ``req_…``), and the gateway's log lines written while it
answered — here the warning that takes a failing backend out of routing, as JSON lines —
carry the same id, and no secret.
"""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.logs import make_handler
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from tests.gateway_stack import RequestIdTap, serve_gateway, snapshot, target

KEY = "sk-request-id-crossing-0001"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@dataclass
class Env:
    tap: RequestIdTap
    engine_url: str
    client: openai.OpenAI
    log: io.StringIO

    def lines(self) -> list[dict[str, str]]:
        return [json.loads(line) for line in self.log.getvalue().splitlines()]

    def wait_for(self, text: str, timeout_s: float = 5.0) -> list[dict[str, str]]:
        """The lines containing ``text``, once there is one (the gateway's thread)."""
        deadline = time.monotonic() + timeout_s
        while not (found := [x for x in self.lines() if text in x["message"]]):
            assert time.monotonic() < deadline, f"no line with {text!r}: {self.lines()}"
            time.sleep(0.01)
        return found


@pytest.fixture
def env() -> Iterator[Env]:
    thread = UvicornThread()
    tap = RequestIdTap(FakeOpenAIBackend(["engine-x"], name="x"))
    engine_url = f"http://127.0.0.1:{thread.serve(tap)}"
    log = io.StringIO()
    handler = make_handler("json", log)  # HETEROFLOW_LOG_FORMAT=json, as the CLI sets it
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with serve_gateway(snapshot({"chat": target("x", engine_url)}, key=KEY), thread) as gw:
            client = openai.OpenAI(
                base_url=f"{gw.url}/v1", api_key=KEY, max_retries=0, timeout=10
            )
            yield Env(tap, engine_url, client, log)
            client.close()
    finally:
        root.removeHandler(handler)
        thread.stop()


@pytest.mark.feature("P3")
def test_the_engine_gets_the_id_the_client_sees(env: Env) -> None:
    raw = env.client.chat.completions.with_raw_response.create(model="chat", messages=MSG)
    assert raw.headers["x-request-id"].startswith("req_")
    assert env.tap.request_ids == [raw.headers["x-request-id"]]
    mine = env.client.chat.completions.with_raw_response.create(
        model="chat", messages=MSG, extra_headers={"X-Request-Id": "trace-crossing-1"}
    )
    assert mine.headers["x-request-id"] == "trace-crossing-1"
    assert env.tap.request_ids[-1] == "trace-crossing-1"


@pytest.mark.feature("P3")
def test_the_gateway_logs_a_request_under_its_id(env: Env) -> None:
    env.tap.app.fail_status = 500  # the engine fails: the gateway ejects it, and says so
    with pytest.raises(openai.InternalServerError) as failed:
        env.client.chat.completions.create(
            model="chat", messages=MSG, extra_headers={"X-Request-Id": "trace-crossing-2"}
        )
    assert failed.value.request_id == "trace-crossing-2"
    assert env.tap.request_ids == ["trace-crossing-2"]
    # the ejection is logged once the answer went out: wait for the gateway to finish
    ejected = env.wait_for("ejected from routing")
    assert len(ejected) == 1, env.lines()
    line = ejected[0]
    assert line["request_id"] == "trace-crossing-2"
    assert line["level"] == "WARNING" and line["logger"] == "heteroflow.gateway.app"
    assert env.engine_url in line["message"]
    assert KEY not in env.log.getvalue()
    # a line written outside any request has no id
    logging.getLogger("heteroflow.gateway.app").warning("between requests")
    (between,) = [x for x in env.lines() if x["message"] == "between requests"]
    assert "request_id" not in between
