"""The spine end to end: API -> scheduler -> agent -> llama.cpp -> gateway -> OpenAI SDK."""

from __future__ import annotations

import os
import signal
from typing import Any

import openai
import pytest

from .conftest import Stack, engine_pid, pid_gone, wait_for

pytestmark = pytest.mark.e2e


def sdk(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=30)


def wait_routable(st: Stack, key: str, model: str, base: str | None = None) -> None:
    client = sdk(base or st.gateway_url, key)

    def answers() -> bool:
        try:
            client.completions.create(model=model, prompt="x", max_tokens=1)
        except openai.APIStatusError as exc:
            if exc.status_code not in (401, 503):  # key or backend not in the snapshot yet
                raise
            return False
        return True

    # the gateway's snapshot is fresh within 2 s of the task turning running
    wait_for(answers, 5, f"{model} routable via {base or st.gateway_url}", 0.1)


@pytest.mark.feature("M1", "A6", "C1", "C6", "C10", "C13", "P1", "M6", "M12")
def test_a_model_file_becomes_an_endpoint_the_openai_sdk_calls(stack: Stack) -> None:
    g = stack.create_service("chat")
    key, model = g["api_key"], "chat-model"
    g = stack.wait_status(g["id"], "running")
    task = g["tasks"][0]
    assert task["node_id"] and task["ports"][0]["host_port"] > 0
    launched = stack.api("GET", f"/api/v1/tasks/{task['id']}").json()["launch_argv"]
    assert "heteroflow.engines.llamacpp_server" in launched and "--metrics" in launched
    node = stack.api("GET", "/api/v1/nodes").json()[0]
    assert node["engines"] == {"llamacpp": ""}  # what the process runtime can start here
    assert [(m["name"], m["format"]) for m in node["models"]] == [("tiny", "gguf")]  # C10

    def shipped() -> bool:  # C6: the engine's own output reaches the server
        chunks = stack.api("GET", f"/api/v1/tasks/{task['id']}/logs").json()["chunks"]
        return "llama.cpp server listening on" in "".join(c["text"] for c in chunks)

    wait_for(shipped, 10, "engine output shipped to the server")
    wait_routable(stack, key, model)
    client = sdk(stack.gateway_url, key)

    assert [m.id for m in client.models.list()] == [model]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 8

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # deterministic at temperature 0

    comp = client.completions.create(model=model, prompt="once upon", max_tokens=6, temperature=0)
    assert comp.choices[0].text

    emb = client.embeddings.create(model=model, input=["a b c", "hello"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == 64

    # the all-in-one port serves /v1 too
    same = sdk(stack.server_url, key).chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=8, temperature=0
    )
    assert same.choices[0].message.content == chat.choices[0].message.content

    # issue 33: a max_tokens no context can hold is refused at once, as OpenAI does (the
    # engine's -c 1024 is the group's context), not generated until the client leaves
    with pytest.raises(openai.BadRequestError) as too_many:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=10**9
        )
    assert (too_many.value.param, too_many.value.code) == ("max_tokens", "invalid_value")
    assert "maximum context length is 1024 tokens" in too_many.value.message

    with pytest.raises(openai.AuthenticationError) as bad_key:
        sdk(stack.gateway_url, "sk-00000000-0000-0000-0000-000000000000").models.list()
    assert bad_key.value.status_code == 401
    assert bad_key.value.code == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    assert unknown.value.code == "model_not_found"


@pytest.mark.feature("C2")
def test_a_killed_engine_is_detected_and_the_task_fails_with_a_reason(stack: Stack) -> None:
    g = stack.create_service("victim")
    g = stack.wait_status(g["id"], "running")
    task = g["tasks"][0]
    pid = engine_pid(task["ports"][0]["host_port"])
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    # the task fails with why (the recovery loop then replaces it: tests/e2e/test_self_healing)
    t = wait_for(
        lambda: (t := stack.api("GET", f"/api/v1/tasks/{task['id']}").json())["status"]
        == "failed" and t,
        15, "the killed engine's task to fail",
    )
    assert "exited with code -9" in t["status_message"]


@pytest.mark.feature("A6", "M1")
def test_deleting_a_service_stops_its_engine_frees_it_and_kills_its_key(stack: Stack) -> None:
    g = stack.create_service("doomed")
    key = g["api_key"]
    g = stack.wait_status(g["id"], "running")
    task = g["tasks"][0]
    pid = engine_pid(task["ports"][0]["host_port"])
    assert pid is not None
    wait_routable(stack, key, "doomed-model")

    assert stack.api("DELETE", f"/api/v1/task-groups/{g['id']}").status_code == 204
    wait_for(lambda: pid_gone(pid), 15, f"engine pid {pid} to exit")
    wait_for(
        lambda: stack.api("GET", f"/api/v1/tasks/{task['id']}").json()["status"] == "stopped",
        10,
        "task stopped",
    )
    client = sdk(stack.gateway_url, key)

    def rejected() -> bool:
        try:
            client.models.list()
        except openai.AuthenticationError:
            return True
        return False

    wait_for(rejected, 5, "the deleted service's key to stop working", 0.1)
    # its host port is free again: a new service that asks for it (an operator may name a
    # host port) is placed on it and runs there. (Not "the next service gets it": the
    # pool hands out its lowest free port, and an earlier test's rebuild may free a lower.)
    freed = task["ports"][0]["host_port"]
    g2 = stack.create_service(
        "reuse",
        task={"image": "ghcr.io/ggml-org/llama.cpp:server", "gpu_required": 0,
              "model_path": str(stack.model_file), "memory_mb": 512,
              "engine_args": ["-np", "2", "-c", "1024"],
              "ports": [{"container_port": 8000, "host_port": freed}]},
    )
    g2 = stack.wait_status(g2["id"], "running")
    assert g2["tasks"][0]["ports"][0]["host_port"] == freed


@pytest.mark.feature("P2")
def test_a_busy_host_port_is_never_handed_out(stack: Stack) -> None:
    """Another program listens on a port: the agent reports it, the scheduler neither
    gives it from the pool nor places a service that asks for it — it waits, saying why,
    and runs on that port once it is free. (A port found taken at launch between two
    heartbeats: tests/integration/test_free_ports.py.)"""
    import socket as _socket

    busy = _socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = busy.getsockname()[1]
    try:
        wait_for(
            lambda: port in stack.api("GET", "/api/v1/nodes").json()[0]["host_ports_in_use"],
            10,
            "the agent to report the port in use",
        )
        g = stack.create_service(
            "waits", task={**_task(stack), "ports": [{"container_port": 8000, "host_port": port}]}
        )
        # pending, with the scheduler's reason once its next round has looked at it
        wait_for(
            lambda: "requested host port in use"
            in stack.group(g["id"])["tasks"][0]["status_message"],
            15, "the pending reason naming the port",
        )
        assert stack.group(g["id"])["status"] == "pending"
    finally:
        busy.close()
    g = stack.wait_status(g["id"], "running", 30)
    assert g["tasks"][0]["ports"][0]["host_port"] == port


def _task(stack: Stack) -> dict[str, Any]:
    return {
        "image": "ghcr.io/ggml-org/llama.cpp:server",
        "gpu_required": 0,
        "model_path": str(stack.model_file),
        "memory_mb": 512,
        "engine_args": ["-np", "1", "-c", "512"],
    }
