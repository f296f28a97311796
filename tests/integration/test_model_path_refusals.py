"""Every ``model_path`` refusal that needs none of the node's files is made at the request
(issue 26, item 5): create and dry run answer 400 naming ``task.model_path`` and write
nothing (no group, task, endpoint with its key, route), and the agent — Docker and
process runtime — refuses the same path with the same words, because both ask the one
function (``core.paths.model_path_refusal``). What needs the node's files (a symlink
leading out, a missing file, a folder without a GGUF) stays the agent's
(tests/unit/test_agent_models.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import func, select

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.container_launch import build_container
from heteroflow.agent.launch import build_launch
from heteroflow.agent.models import THIS_NODE
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.engines import resolve_engine
from heteroflow.db.tables import Event, InferenceEndpoint, ModelRoute, Task, TaskGroup
from heteroflow.schemas.nodes import TaskAssignment

from .conftest import NODE_TOKEN, Api, service_body

pytestmark = pytest.mark.feature("C4")

LLAMA = "ghcr.io/ggml-org/llama.cpp:server"
VLLM = "vllm/vllm-openai:v0.11.2"
TRT = "nvcr.io/nvidia/tensorrt-llm/release:0.20.0"
ALLOWED, DENIED = "/models", "/models/private"
SERVER_SCOPE = "of every node you may use"

# (case, task fields, group fields, words the refusal holds)
CASES: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    ("control character", {"model_path": "/models/a\n.gguf"}, {}, "control character"),
    ("tab in a name", {"model_path": "tiny\t.gguf"}, {}, "U+0009"),
    ("longer than 4096 bytes", {"model_path": "/models/" + "é" * 2100}, {}, "4096 bytes"),
    ("a name over 255 bytes", {"model_path": "/models/" + "a" * 300 + ".gguf"}, {}, "255"),
    ("absolute '..'", {"model_path": "/models/../etc/passwd"}, {}, "'..'"),
    ("relative '..'", {"model_path": "org/../../secret.gguf"}, {}, "'..'"),
    ("whitespace at an end", {"model_path": "tiny.gguf "}, {}, "whitespace"),
    ("leading whitespace", {"model_path": " /models/a.gguf"}, {}, "whitespace"),
    # issue 29: a model source is fetched by the node, but not every source is one
    ("a URL in clear", {"model_path": "http://example.com/a.gguf"}, {}, "loopback host"),
    ("a URL with a password", {"model_path": "https://u:p@example.com/a.gguf"}, {}, "user"),
    ("a hub repository for llama.cpp", {"model_path": "hf://org/model"}, {},
     "loads one GGUF file"),
    ("an unknown scheme", {"model_path": "s3://bucket/a.gguf"}, {}, "accepted:"),
    ("home directory", {"model_path": "~/models/tiny.gguf"}, {}, "'~'"),
    ("the model directory itself", {"model_path": "./"}, {}, "model directory itself"),
    ("outside the allow-list", {"model_path": "/etc/passwd"}, {}, "allowed: /models"),
    ("string prefix, not a segment", {"model_path": "/models-evil/a.gguf"}, {}, "outside"),
    ("under a denied prefix", {"model_path": "/models/private/a.gguf"}, {}, DENIED),
    ("llama.cpp given safetensors", {"model_path": "/models/q/model.safetensors"}, {},
     "GGUF models only"),
    ("TensorRT-LLM given a relative path",
     {"image": TRT, "model_path": "engines/llama", "gpu_required": 1}, {}, "absolute path"),
    ("an engine task without a model",
     {"image": VLLM, "model_path": "", "gpu_required": 1}, {"task_type": "container"},
     "no model_path: engine vllm"),
]


def beat(api: Api) -> str:
    r = api.client.post(
        "/api/v1/agent/heartbeat",
        json={"name": "node-a", "address": "127.0.0.1", "runtime": "docker",
              "allowed_volume_prefixes": [ALLOWED], "denied_volume_prefixes": [DENIED],
              "inventory": {"gpus": [], "cpu_count": 4, "memory_total_mb": 16384,
                            "memory_available_mb": 16384}},
        headers={"Authorization": f"Bearer {NODE_TOKEN}"},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["node_id"])


def written(api: Api) -> list[int]:
    with api.app.db.session() as s:
        return [
            int(s.scalar(select(func.count()).select_from(t)) or 0)
            for t in (TaskGroup, Task, InferenceEndpoint, ModelRoute, Event)
        ]


def assignment(task: dict[str, Any], engine: str) -> TaskAssignment:
    return TaskAssignment(
        id="task-1", group_id="tg-1", name="svc-0", status="starting",
        task_type="inference", model_name="svc", model_path=task.get("model_path", ""),
        image=task.get("image", LLAMA), engine=engine, command=[], engine_args=[], env=[],
        ports=[{"container_port": 8000, "host_port": 21000}], gpu_ids=[], gpu_required=0,
        memory_mb=0, health_check={},
    )


def agent_refusals(task: dict[str, Any], engine: str, tmp: Path) -> list[str]:
    """What the node says of the same path: the Docker launcher, and (llama.cpp) the
    process runtime's."""
    config = NodeConfig.from_dict(
        {"allowed_volume_prefixes": [ALLOWED], "denied_volume_prefixes": [DENIED]}
    )
    t = assignment(task, engine)
    said = []
    with pytest.raises(LaunchFailed) as docker:
        build_container(t, config, address="127.0.0.1", cards=(), work_dir=tmp)
    said.append(str(docker.value))
    if engine == "llamacpp":
        with pytest.raises(LaunchFailed) as process:
            build_launch(t, config, cpu_threads=1, log_dir=tmp)
        said.append(str(process.value))
    return said


@pytest.mark.parametrize(("case", "task", "group", "words"), CASES, ids=[c[0] for c in CASES])
def test_a_refusal_is_400_at_create_and_dry_run_and_the_agents_own(
    api: Api, tmp_path: Path, case: str, task: dict[str, Any], group: dict[str, Any],
    words: str,
) -> None:
    admin = api.login()
    member = api.member(admin, "tn-m", "mia")
    beat(api)
    before = written(api)
    body = service_body(task=task, **group)
    answers = []
    for url in ("/api/v1/task-groups?dry_run=true", "/api/v1/task-groups"):
        for who in (member, admin):
            r = api.client.post(url, json=body, headers=who)
            assert r.status_code == 400, (url, r.text)
            err = r.json()["error"]
            assert err["code"] == "validation_error" and err["field"] == "task.model_path", err
            assert words in err["message"], err
            answers.append(err["message"])
    assert len(set(answers)) == 1  # create and dry run: one decision, one answer
    assert written(api) == before  # no group, task, endpoint (key), route, event
    engine, _ = resolve_engine("", "", task.get("image", LLAMA))
    for said in agent_refusals(task, engine, tmp_path):
        assert said == answers[0].replace(SERVER_SCOPE, THIS_NODE), case


@pytest.mark.parametrize(
    "task",
    [
        {"model_path": "/models/a.gguf"},
        {"model_path": "org/tiny.gguf"},
        {"model_path": "a..b/c.gguf"},  # a name holding dots, not a '..' segment
        {"model_path": "/models/private-not/a.gguf"},  # segment boundaries
        # TensorRT-LLM's engine directory is inside its image: no host rule applies
        {"image": TRT, "model_path": "/opt/engines/llama", "gpu_required": 1},
        {"model_path": "/models/q/model.safetensors", "command": ["python3", "serve.py"]},
    ],
    ids=["absolute", "relative", "dots-in-a-name", "segment-boundary", "trtllm", "command"],
)
def test_what_the_node_alone_can_tell_is_accepted(api: Api, task: dict[str, Any]) -> None:
    admin = api.login()
    beat(api)
    r = api.client.post("/api/v1/task-groups", json=service_body(task=task), headers=admin)
    assert r.status_code == 201, r.text


def test_the_scheduler_places_an_absolute_path_only_where_its_node_allows_it(api: Api) -> None:
    """Create accepts a path some node allows; the node chosen must be one of those (its
    agent would refuse the path after the 201 otherwise): the scheduler's node gate asks
    the same rule, and the dry run shows the same node."""
    admin = api.login()
    nodes = {"node-a": api.heartbeat("node-a", allowed=["/models"]),
             "node-b": api.heartbeat("node-b", allowed=["/data"])}
    for path, where in (("/data/x.gguf", "node-b"), ("/models/x.gguf", "node-a")):
        body = service_body(name=where, task={"model_path": path})
        plan = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
        assert plan.json()["tasks"][0]["placement"]["node_name"] == where, plan.text
        r = api.client.post("/api/v1/task-groups", json=body, headers=admin)
        assert r.status_code == 201, r.text
        api.app.scheduler.run_round()
        t = api.client.get(f"/api/v1/tasks/{r.json()['tasks'][0]['id']}", headers=admin).json()
        assert (t["status"], t["node_id"]) == ("scheduled", nodes[where]), t
    # the only node that allows it is gone: the task waits, saying why not elsewhere
    api.clock.advance(api.app.settings.node_offline_after_s + 1)
    api.heartbeat("node-a", allowed=["/models"])
    r = api.client.post(
        "/api/v1/task-groups", json=service_body(name="c", task={"model_path": "/data/y.gguf"}),
        headers=admin,
    )
    assert r.status_code == 201, r.text  # node-b is registered: it may come back
    api.app.scheduler.run_round()
    t = api.client.get(f"/api/v1/tasks/{r.json()['tasks'][0]['id']}", headers=admin).json()
    assert t["status"] == "pending" and "allowed volume prefixes" in t["status_message"], t
