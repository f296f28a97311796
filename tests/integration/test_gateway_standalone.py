"""``heteroflow gateway --routes FILE`` as a real process: no server, a fake engine, the
OpenAI SDK; reload on SIGHUP, /metrics, usage to a JSON-lines file flushed at exit, and
a bad routing file refused with exit code 2 and the field named.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.cli import main
from heteroflow.schemas.routing import hash_key
from heteroflow.testing.fake_openai_backend import FakeOpenAIBackend, UvicornThread
from heteroflow.testing.up_stack import listening_url

KEY = "sk-standalone-test-key"
MSG: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[FakeOpenAIBackend, str]]:
    thread = UvicornThread()
    fake = FakeOpenAIBackend(["engine-s"], name="s")
    url = f"http://127.0.0.1:{thread.serve(fake)}/v1"
    try:
        yield fake, url
    finally:
        thread.stop()


def _routes(url: str, models: tuple[str, ...] = ("chat",)) -> dict[str, Any]:
    return {
        "models": {m: {"algorithm": "least_connections", "backends": [url]} for m in models},
        "keys": {"edge-1": {"sha256": hash_key(KEY), "tenant": "edge", "rpm_limit": 0}},
    }


class Gateway:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc = proc
        self.url = url
        self.client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=10)


def _start(args: list[str]) -> subprocess.Popen[str]:
    env = {**os.environ, "HETEROFLOW_ROUTES_RELOAD_INTERVAL_S": "3600"}  # SIGHUP reloads
    return subprocess.Popen(
        [sys.executable, "-m", "heteroflow.cli", "gateway", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


@pytest.fixture
def gateway(tmp_path: Path, engine: tuple[FakeOpenAIBackend, str]) -> Iterator[Gateway]:
    routes = tmp_path / "routes.json"
    routes.write_text(json.dumps(_routes(engine[1])))
    proc = _start(["--routes", str(routes), "--usage-log", str(tmp_path / "usage.jsonl")])
    try:
        assert proc.stdout is not None
        gw = Gateway(proc, listening_url(proc.stdout, "the gateway", 30))
        yield gw
        gw.client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.feature("M1")
@pytest.mark.feature("M7")
@pytest.mark.feature("P3")
def test_standalone_gateway_serves_reloads_counts_and_flushes_at_exit(
    gateway: Gateway, tmp_path: Path, engine: tuple[FakeOpenAIBackend, str]
) -> None:
    client = gateway.client
    r = client.chat.completions.create(model="chat", messages=MSG, extra_body={"fake_chunks": 2})
    assert r.choices[0].message.content == "tok tok"
    # remapped to the engine's own id, as with a server; answered by the name called
    assert engine[0].received_models[-1] == "engine-s" and r.model == "chat"
    chunks = list(
        client.chat.completions.create(
            model="chat", messages=MSG, stream=True, extra_body={"fake_prompt_tokens": 3}
        )
    )
    assert all(c.choices for c in chunks)  # no usage chunk the client did not ask for
    assert [m.id for m in client.models.list()] == ["chat"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="code", messages=MSG)

    # a new model in the file, then SIGHUP: callable without a restart
    (tmp_path / "routes.json").write_text(json.dumps(_routes(engine[1], ("chat", "code"))))
    gateway.proc.send_signal(signal.SIGHUP)
    _wait_until(lambda: "code" in [m.id for m in client.models.list()])
    client.chat.completions.create(model="code", messages=MSG)

    metrics = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    assert (
        'heteroflow_gateway_requests_total{path="/v1/chat/completions",model="chat",status="200"} 2'
        in metrics
    )
    assert (
        'heteroflow_gateway_requests_total{path="/v1/chat/completions",model="",status="404"} 1'
        in metrics
    )
    assert 'heteroflow_gateway_tokens_total{model="chat",kind="prompt"} 4' in metrics

    assert not (tmp_path / "usage.jsonl").exists()  # nothing flushed yet (5 s interval)
    gateway.proc.send_signal(signal.SIGTERM)
    assert gateway.proc.wait(30) == 0
    rows = [json.loads(line) for line in (tmp_path / "usage.jsonl").read_text().splitlines()]
    sums: dict[str, tuple[int, int, int]] = {}
    for row in rows:
        assert (row["endpoint_id"], row["tenant_id"]) == ("edge-1", "edge")
        req, p, c = sums.get(row["model"], (0, 0, 0))
        sums[row["model"]] = (
            req + row["requests"],
            p + row["prompt_tokens"],
            c + row["completion_tokens"],
        )
    assert sums == {"chat": (2, 4, 5), "code": (1, 1, 3)}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (
            {"models": {"chat": {"backends": ["localhost:8000"]}}, "keys": {}},
            "models.chat.backends[0]",
        ),
        ({"models": {}, "keys": {"k": {"key": "sk-plain"}}}, "keys.k.key: plaintext keys"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_routes_file_exits_2_naming_the_field(
    tmp_path: Path, content: Any, expected: str
) -> None:
    routes = tmp_path / "routes.json"
    routes.write_text(content if isinstance(content, str) else json.dumps(content))
    proc = _start(["--routes", str(routes)])
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2
    assert f"routes file {routes}: " in err and expected in err
    assert "Traceback" not in err


@pytest.mark.feature("N2")
def test_a_tenant_quota_in_the_routes_file_is_spent_by_its_keys_together(
    tmp_path: Path, engine: tuple[FakeOpenAIBackend, str]
) -> None:
    """The routes file's ``tenants``: 8 tokens a day for tenant ``edge``, two keys of it
    and one of another tenant; the fake engine answers 4 tokens a request. Two requests
    (one per key) spend it, then both keys are refused as by the server's tenant quota
    and the other tenant's key is not."""
    keys = {name: f"sk-{name}-quota-test" for name in ("edge-1", "edge-2", "other-1")}
    routes = tmp_path / "routes.json"
    routes.write_text(
        json.dumps(
            {
                "models": {"chat": {"backends": [engine[1]]}},
                "keys": {
                    name: {"sha256": hash_key(k), "tenant": name.split("-")[0]}
                    for name, k in keys.items()
                },
                "tenants": {"edge": {"quota_tokens": 8, "quota_period": "day"}},
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if k != "HETEROFLOW_REDIS_URL"}  # in memory
    proc = subprocess.Popen(
        [sys.executable, "-m", "heteroflow.cli", "gateway", "--port", "0", "--routes", str(routes)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    clients: list[openai.OpenAI] = []
    try:
        assert proc.stdout is not None
        url = listening_url(proc.stdout, "the gateway", 30)

        def client(name: str) -> openai.OpenAI:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key=keys[name], max_retries=0, timeout=10)
            clients.append(c)
            return c

        def chat(c: openai.OpenAI) -> str:
            r = c.chat.completions.create(model="chat", messages=MSG, max_tokens=5)
            return r.choices[0].message.content or ""

        one, two = client("edge-1"), client("edge-2")
        assert chat(one) == "tok tok tok"  # 1 prompt + 3 completion tokens
        assert chat(two) == "tok tok tok"  # 8: the tenant's day is spent
        for c in (one, two):
            with pytest.raises(openai.RateLimitError) as refused:
                chat(c)
            assert refused.value.code == "insufficient_quota"
            assert "tenant's token quota of 8 tokens per day" in refused.value.message
        assert chat(client("other-1")) == "tok tok tok"  # another tenant: no quota
    finally:
        for c in clients:
            c.close()
        proc.kill()
        proc.wait(10)


def test_cli_arguments_and_hash_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["hash-key", KEY]) == 0
    assert capsys.readouterr().out.strip() == hash_key(KEY)
    assert main(["hash-key", "--new"]) == 0
    out = capsys.readouterr().out
    key = re.search(r"key \(shown once\): (sk-\S+)", out)
    assert key and f"sha256: {hash_key(key.group(1))}" in out
    assert main(["gateway"]) == 2  # neither --server nor --routes
    assert main(["gateway", "--server", "http://x", "--routes", "r.json"]) == 2
    assert main(["gateway", "--server", "http://x", "--usage-log", "u"]) == 2
    assert "--usage-log is for --routes" in capsys.readouterr().err


def _wait_until(cond: Any, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def _dead_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/v1"


@pytest.mark.parametrize(("retries", "failures"), [("0", 1), ("1", 0)])
def test_gateway_settings_reach_the_separate_gateway_process(
    tmp_path: Path, engine: tuple[FakeOpenAIBackend, str], retries: str, failures: int
) -> None:
    """Issue 11: the separate gateway used to ignore gateway settings the all-in-one
    honoured. Both build it with ``GatewayApp.from_settings``; here the failover setting
    (HETEROFLOW_GATEWAY_CONNECT_RETRIES) visibly changes what a client gets when the
    first backend in turn is down."""
    routes = _routes(engine[1])
    routes["models"]["chat"] = {"algorithm": "round_robin", "backends": [_dead_url(), engine[1]]}
    (tmp_path / "routes.json").write_text(json.dumps(routes))
    proc = subprocess.Popen(
        [sys.executable, "-m", "heteroflow.cli", "gateway", "--port", "0",
         "--routes", str(tmp_path / "routes.json")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # probes off (a second setting that must reach it): else they eject the dead
        # backend before any request does
        env={**os.environ, "HETEROFLOW_GATEWAY_CONNECT_RETRIES": retries,
             "HETEROFLOW_GATEWAY_PROBE_INTERVAL_S": "0"},
    )
    try:
        assert proc.stdout is not None
        gw = Gateway(proc, listening_url(proc.stdout, "the gateway", 30))
        seen = 0
        for _ in range(2):  # round robin: one of the two starts at the dead backend
            try:
                gw.client.chat.completions.create(model="chat", messages=MSG)
            except openai.APIStatusError as exc:
                assert exc.status_code == 502
                seen += 1
        assert seen == failures
        gw.client.close()
    finally:
        proc.kill()
        proc.wait(10)


def test_the_all_in_one_builds_its_gateway_from_the_same_settings(tmp_path: Path) -> None:
    from heteroflow.server import ServerApp
    from heteroflow.settings import ServerSettings

    settings = ServerSettings(
        data_dir=tmp_path, gateway_connect_retries=0, upstream_timeout_s=42.0,
        gateway_auto_long_prompt_tokens=123, gateway_retry_unanswered=False,
    )
    app = ServerApp(settings)
    try:
        assert app.gateway._forwarder._connect_retries == 0
        assert app.gateway._forwarder._retry_unanswered is False
        assert app.gateway._router._auto_long_prompt_tokens == 123
        assert app.gateway._upstream._read_timeout_s == 42.0
    finally:
        app.db.dispose()
