"""The llama.cpp launcher as a real subprocess serving the tiny model over OpenAI's HTTP API."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from heteroflow.core.engines.registry import ENGINES
from heteroflow.engines.llamacpp_server import READY_PREFIX
from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.gateway_stack import ALIAS, LAUNCHER, Engine, start_engine

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "temperature": 0, "max_tokens": 8}


def _stop(engine: Engine, sig: signal.Signals = signal.SIGTERM) -> int:
    engine.proc.send_signal(sig)
    return engine.proc.wait(timeout=5)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("models") / "heteroflow-tiny.gguf")


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with start_engine(tiny_model, log, "--embeddings", "--metrics") as running:
        yield running


@pytest.fixture(scope="module")
def client(engine: Engine) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.url, timeout=10) as http:
        yield http


def test_ready_line_names_the_address(engine: Engine) -> None:
    assert f"{READY_PREFIX}{engine.url}" in engine.log.read_text()


def test_models_lists_the_alias(client: httpx.Client) -> None:
    body = client.get("/v1/models").json()
    assert [model["id"] for model in body["data"]] == [ALIAS]


def _chat(client: httpx.Client) -> str:
    response = client.post("/v1/chat/completions", json={**CHAT, "model": ALIAS})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 8
    content = choice["message"]["content"]
    assert isinstance(content, str)
    return content


def test_chat_completion_is_deterministic_printable_text(client: httpx.Client) -> None:
    first = _chat(client)
    assert len(first) == 8 and first.isascii() and first.isprintable()
    assert _chat(client) == first


def test_chat_completion_streams_sse_until_done(client: httpx.Client) -> None:
    expected = _chat(client)
    lines: list[str] = []
    with client.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "model": ALIAS, "stream": True}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks)
    assert text == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_text_completion(client: httpx.Client) -> None:
    body = {"model": ALIAS, "prompt": "Once upon", "temperature": 0, "max_tokens": 8}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert len(choice["text"]) == 8 and choice["text"].isprintable()


def test_embeddings_return_one_vector_per_input(client: httpx.Client) -> None:
    response = client.post("/v1/embeddings", json={"model": ALIAS, "input": ["alpha", "beta"]})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [item["index"] for item in data] == [0, 1]
    assert {len(item["embedding"]) for item in data} == {64}
    assert data[0]["embedding"] != data[1]["embedding"]


def test_metrics_endpoint(client: httpx.Client) -> None:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert "llamacpp:prompt_tokens_total" in response.text
    # the load metrics the autoscaler reads (the registry's names; H8 labels them verified)
    for name in ENGINES["llamacpp"].metrics.values():
        assert f"{name} " in response.text, name


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_promptly_with_status_0(
    tiny_model: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    engine = start_engine(tiny_model, tmp_path / "engine.log")
    # Without --embeddings the route exists but refuses, as llama-server does.
    assert httpx.post(f"{engine.url}/v1/embeddings", json={"input": "x"}).status_code == 501
    started = time.monotonic()
    assert _stop(engine, sig) == 0
    assert time.monotonic() - started < 5


_BURST = """
import os, signal, sys, time
pid, until = int(sys.argv[1]), time.monotonic() + 0.5
try:
    while time.monotonic() < until:
        os.kill(pid, signal.SIGTERM)
except ProcessLookupError:
    pass
"""


@pytest.mark.feature("C8")
def test_a_burst_of_sigterms_still_stops_it(tiny_model: Path, tmp_path: Path) -> None:
    """An agent killed hard sends its engines one SIGTERM per thread that dies
    (``PR_SET_PDEATHSIG`` fires each time the child is handed to the next thread): a
    handler that took a lock deadlocked when the next signal interrupted it holding that
    lock, and the engine outlived the agent for good (an orphan found after a CI run)."""
    for _ in range(10):  # the old handler hung in about one burst in ten
        engine = start_engine(tiny_model, tmp_path / "engine.log")
        # two other processes, as fast as they can, until the engine is gone (or 0.5 s)
        senders = [
            subprocess.Popen([sys.executable, "-c", _BURST, str(engine.proc.pid)])
            for _ in range(2)
        ]
        for sender in senders:
            sender.wait(timeout=30)
        try:
            # it stops (0), or is ended by a signal of the burst that came after its own
            # handlers were gone, on its way out
            assert engine.proc.wait(timeout=10) in (0, -signal.SIGTERM)
        finally:
            if engine.proc.poll() is None:
                engine.proc.kill()
                engine.proc.wait()


@pytest.mark.feature("H4")
def test_unknown_flag_exits_2_naming_it(tiny_model: Path) -> None:
    done = subprocess.run(
        [*LAUNCHER, "-m", str(tiny_model), "--no-such-flag"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2
    assert "--no-such-flag" in done.stderr


def test_missing_model_exits_1(tmp_path: Path) -> None:
    done = subprocess.run(
        [*LAUNCHER, "-m", str(tmp_path / "absent.gguf"), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 1
    assert "absent.gguf" in done.stderr
