"""A LoRA adapter loaded at runtime into the real vLLM and served under its own model name
(issue 28 item 1, H10): API → agent (process runtime) → vLLM's CPU build → gateway → the
OpenAI SDK.

One stack and one vLLM server for the module, started with ``max_loras`` 2 (on the CPU
build one adapter per server: with every slot used, base-model requests answer with the
last adapter). The base model is ``models/tiny_hf``'s and the adapter
``models/tiny_lora``'s, made locally: its ``lm_head`` LoRA turns the chat reply into the
story the base model tells, so which of the two answered is a known string. vLLM comes
from the venv ``scripts/_venv.sh ensure_vllm`` builds; without it the module is skipped
(and fails under CI, which sets ``HETEROFLOW_REQUIRE_VLLM=1``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.models.tiny_hf import EXPECTED, TINY_HF_DIR_NAME, write_tiny_hf
from heteroflow.models.tiny_lora import EXPECTED_CHAT, write_tiny_lora

from .conftest import Stack, launch_stack, wait_for
from .test_vllm_real import vllm_python

pytestmark = pytest.mark.e2e

MODEL = "tiny-base"
ADAPTER = "tiny-once"
ENGINE_ARGS = ["--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager"]
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]


@dataclass
class Served:
    stack: Stack
    group: dict[str, Any]
    key: str
    lora_dir: Path

    @property
    def task_id(self) -> str:
        return str(self.group["tasks"][0]["id"])

    def task(self) -> dict[str, Any]:
        return dict(self.stack.api("GET", f"/api/v1/tasks/{self.task_id}").json())

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.stack.gateway_url + "/v1", api_key=self.key, max_retries=0,
            timeout=60,
        )

    def chat(self, model: str) -> str:
        got = self.client().chat.completions.create(
            model=model, messages=HELLO, max_tokens=16, temperature=0
        )
        return got.choices[0].message.content or ""

    def adapters(self, method: str = "GET", suffix: str = "", **kw: Any) -> httpx.Response:
        return self.stack.api(
            method, f"/api/v1/task-groups/{self.group['id']}/adapters{suffix}", **kw
        )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm-lora")
    start = random.randint(20000, 29000)
    with launch_stack(
        tmp,
        node_name="vllm-lora-node",
        server_env={
            "HETEROFLOW_PORT_POOL_START": str(start),
            "HETEROFLOW_PORT_POOL_END": str(start + 40),
        },
        agent_env={
            "HETEROFLOW_AGENT_VLLM_PYTHON": python,
            "HETEROFLOW_AGENT_LORA_RETRY_BASE_S": "0.5",
            "HETEROFLOW_AGENT_LORA_RETRY_MAX_S": "2",
        },
    ) as st:
        model_dir = write_tiny_hf(st.models_dir / TINY_HF_DIR_NAME)
        lora_dir = write_tiny_lora(st.models_dir / "loras" / "once")  # under the allow-list
        body = {
            "name": "vllm-lora",
            "model_name": MODEL,
            "health_check": {"interval_seconds": 0.5, "start_period_seconds": 600},
            "task": {
                "engine": "vllm",
                "image": "vllm/vllm-openai:v0.32.0",
                "gpu_required": 0,
                "model_path": str(model_dir),
                "memory_mb": 4096,
                "engine_args": ENGINE_ARGS,
                "env": ["VLLM_NO_USAGE_STATS=1"],
                "max_loras": 2,
            },
        }
        r = st.api("POST", "/api/v1/task-groups", json=body)
        assert r.status_code == 201, r.text
        try:
            g = st.wait_status(r.json()["id"], "running", timeout_s=600)
        except AssertionError as exc:
            logs = sorted((st.tmp / "agent" / "logs").glob("*.log"))
            tail = "\n".join(p.read_text(errors="replace")[-6000:] for p in logs)
            raise AssertionError(f"{exc}\n{tail}\n{st.logs()}") from exc
        s = Served(st, g, r.json()["api_key"], lora_dir)
        wait_for(lambda: answers(s, MODEL), 20, f"{MODEL} routable", 0.2)
        yield s


def answers(s: Served, model: str) -> str | None:
    """The chat answer under ``model``, None while it is not served yet (the name is not
    routed yet: 401/404 from the gateway; not loaded yet: vLLM's 404)."""
    try:
        return s.chat(model)
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 404, 503):
            return None
        raise


def engine_process(port: int) -> psutil.Process:
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and str(port) in cmd:
            return p
    raise AssertionError(f"no vLLM api_server process on port {port}")


@pytest.mark.feature("H10")
def test_an_adapter_loaded_at_runtime_answers_under_its_own_name(served: Served) -> None:
    task = served.task()
    argv = task["launch_argv"]
    at = argv.index("--enable-lora")
    assert argv[at:at + 3] == ["--enable-lora", "--max-loras", "2"]
    port = int(task["ports"][0]["host_port"])
    engine = engine_process(port)
    assert engine.environ()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert served.chat(MODEL) == EXPECTED["chat"]

    r = served.adapters("POST", json={"name": ADAPTER, "path": str(served.lora_dir)})
    assert r.status_code == 201, r.text
    # the agent loads it into the running engine (no restart): the same engine process
    got = wait_for(lambda: answers(served, ADAPTER), 60, f"{ADAPTER} answering", 0.3)
    assert got == EXPECTED_CHAT
    assert engine_process(port).pid == engine.pid
    # the base model still answers as itself; both names are the key's models (and
    # "auto", which a key with more than one model may call)
    assert served.chat(MODEL) == EXPECTED["chat"]
    assert {m.id for m in served.client().models.list()} == {MODEL, ADAPTER, "auto"}
    stream = served.client().chat.completions.create(
        model=ADAPTER, messages=HELLO, max_tokens=16, temperature=0, stream=True,
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        EXPECTED_CHAT
    )
    assert all(c.model == ADAPTER for c in chunks)
    # what the engine serves is said on the task and in its events
    said = f"serving LoRA adapter(s): {ADAPTER}"
    wait_for(lambda: served.task()["status_message"] == said, 10, "the agent's note")
    events = served.stack.api("GET", f"/api/v1/task-groups/{served.group['id']}/events").json()
    assert any(e["kind"] == "task.lora_adapter" and e["message"] == said for e in events)


@pytest.mark.feature("H10")
def test_a_removed_adapter_stops_answering_and_leaves_the_engine(served: Served) -> None:
    r = served.adapters("DELETE", f"/{ADAPTER}")
    assert r.status_code == 200, r.text

    def refused() -> bool:
        try:
            served.chat(ADAPTER)
        except openai.NotFoundError:
            return True
        return False

    wait_for(refused, 10, f"{ADAPTER} refused by the gateway")
    task = served.task()
    port = int(task["ports"][0]["host_port"])
    key = engine_process(port).environ()["VLLM_API_KEY"]

    def unloaded() -> bool:
        models = httpx.get(
            f"http://127.0.0.2:{port}/v1/models", headers={"Authorization": f"Bearer {key}"}
        ).json()["data"]
        return [m["id"] for m in models] == [MODEL]

    wait_for(unloaded, 20, "the engine to unload it", 0.3)
    assert served.chat(MODEL) == EXPECTED["chat"]


@pytest.mark.feature("H10")
def test_an_adapter_that_cannot_load_is_reported_and_the_base_keeps_serving(
    served: Served,
) -> None:
    empty = served.stack.models_dir / "loras" / "empty"
    empty.mkdir(parents=True)
    r = served.adapters("POST", json={"name": "tiny-broken", "path": str(empty)})
    assert r.status_code == 201, r.text
    wait_for(
        lambda: "'tiny-broken' not loaded" in served.task()["status_message"], 20,
        "the failed load reported",
    )
    task = served.task()
    assert task["status"] == "running" and "not an adapter folder" in task["status_message"]
    assert served.chat(MODEL) == EXPECTED["chat"]
    assert served.adapters("DELETE", "/tiny-broken").status_code == 200
