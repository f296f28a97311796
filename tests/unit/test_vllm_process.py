"""vLLM on the process runtime (issue 28 item 1): the recipe's argv and variables, where
the scheduler places a CPU vLLM task, and what the agent launches and reports.

The real server is run from this argv in tests/e2e/test_vllm_real.py."""

from __future__ import annotations

import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.launch import build_launch
from heteroflow.agent.local_engines import local_engines, vllm_build
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.containers import container_env, process_runs
from heteroflow.core.engines import CommandError, LaunchShape, build_command, process_argv
from heteroflow.core.engines.commands import CPU_KVCACHE_GIB, process_command
from heteroflow.core.engines.flags import accepted_flags
from heteroflow.core.engines.registry import CPU_BUILD, vendors_of
from heteroflow.core.placement.model import CardView, NodeView, Placement, Reservation, TaskDemand
from heteroflow.core.placement.pipeline import place
from heteroflow.models.tiny_hf import TINY_HF_DIR_NAME, write_tiny_hf
from heteroflow.schemas.nodes import TaskAssignment

MODULE = ("-m", "vllm.entrypoints.openai.api_server")
HERMES = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
POOL = range(20000, 20010)


def cpu_shape(**kw: Any) -> LaunchShape:
    base: dict[str, Any] = {
        "engine": "vllm", "model_path": "/models/tiny-hermes", "served_model_name": "tiny",
        "port": 20001, "host": "127.0.0.2", "gpus": 0,
        "extra_args": ("--max-model-len", "256"),
    }
    return LaunchShape(**{**base, **kw})


@pytest.mark.feature("H4")
def test_the_process_runtime_runs_vllm_by_its_api_server_module_with_the_recipes_args() -> None:
    cmd = process_command(cpu_shape(), "/cache/vllm-cpu/bin/python")
    assert cmd.entrypoint is None
    assert cmd.args == (
        "/cache/vllm-cpu/bin/python", *MODULE,
        "--model", "/models/tiny-hermes", "--host", "127.0.0.2", "--port", "20001",
        "--served-model-name", "tiny", "--tensor-parallel-size", "1", *HERMES,
        "--max-model-len", "256",
    )
    # exactly the recipe's arguments after the module (one builder for every runtime)
    recipe = build_command(replace(cpu_shape(), runtime="process"))
    assert recipe.entrypoint == ("python3", *MODULE)
    assert cmd.args[3:] == recipe.args
    assert process_argv(cpu_shape(), "/py") == ["/py", *MODULE, *recipe.args]
    # every flag is one vLLM's api_server accepts (the pinned flag list)
    flags = {a.split("=", 1)[0] for a in cmd.args[3:] if a.startswith("--")}
    assert flags <= accepted_flags("vllm")


@pytest.mark.feature("H4")
def test_a_cpu_vllm_gets_a_kv_cache_size_the_task_may_change_and_no_card_share() -> None:
    cmd = process_command(cpu_shape(), "/py")
    assert "--gpu-memory-utilization" not in cmd.args
    assert dict(cmd.env_defaults) == {
        "VLLM_CPU_KVCACHE_SPACE": str(CPU_KVCACHE_GIB), "HF_HUB_OFFLINE": "1"
    }
    env = container_env(
        ["VLLM_CPU_KVCACHE_SPACE=3"], task_id="t", group_id="g", task_name="n",
        engine="vllm", engine_env=cmd.env, gpu=None, engine_defaults=cmd.env_defaults,
    )
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3" and env["HF_HUB_OFFLINE"] == "1"
    # in an image the entrypoint stays `vllm serve` (the console script works there)
    docker = build_command(cpu_shape())
    assert docker.entrypoint == ("vllm", "serve") and docker.args[0] == "/models/tiny-hermes"
    assert "HF_HUB_OFFLINE" not in docker.env_defaults
    # with a card: the share, no CPU variable
    gpu = build_command(cpu_shape(gpus=1))
    assert "--gpu-memory-utilization" in gpu.args and not gpu.env_defaults
    # what still needs a container, and what vLLM cannot do without a card
    with pytest.raises(CommandError, match="needs a container runtime"):
        process_command(cpu_shape(engine="sglang"), "/py")
    with pytest.raises(CommandError, match="tensor_parallel_size 2"):
        build_command(cpu_shape(tensor_parallel_size=2))
    with pytest.raises(CommandError, match="sglang needs at least one GPU"):
        build_command(cpu_shape(engine="sglang"))


# --- placement ---------------------------------------------------------------


def node(
    name: str, *, runtime: str = "process", engines: dict[str, str] | None = None,
    cards: int = 0,
) -> NodeView:
    return NodeView(
        id=name, name=name, online=True,
        cards=[CardView(i, "nvidia", "H100", 80_000) for i in range(cards)],
        cpu_count=8, memory_total_mb=64_000, runtime=runtime,
        engines=frozenset(engines or {}), engine_images=dict(engines or {}),
        vendor="nvidia" if cards else "",
    )


def demand(engine: str = "vllm", gpus: int = 0) -> TaskDemand:
    return TaskDemand(
        task_id="t1", gpu_required=gpus, gpu_type="", gpu_memory_utilization=90,
        estimated_gpu_memory_mb=1000 if gpus else 0, memory_mb=4096, host_ports=(0,),
        engine=engine, engine_vendors=vendors_of(engine),
    )


def where(t: TaskDemand, *nodes: NodeView) -> str:
    got = place(t, list(nodes), Reservation(), POOL)
    return got.node_id if isinstance(got, Placement) else got.reason


def test_a_cpu_vllm_task_lands_only_where_the_node_runs_vllms_cpu_build() -> None:
    cpu_vllm = node("cpu-vllm", engines={"llamacpp": "", "vllm": CPU_BUILD})
    plain = node("plain", engines={"llamacpp": ""})
    docker = node("docker", runtime="docker", engines={"vllm": "vllm/vllm-openai:v0.11.2"})
    assert where(demand(), plain, docker, cpu_vllm) == "cpu-vllm"
    reason = where(demand(), plain, docker)
    assert "1 node(s): process runtime" in reason  # no vLLM on the plain process node
    assert "1 node(s): cards of a vendor the engine vllm does not run on" in reason
    # llama.cpp is still every process node's own, reported or not (its launcher is ours)
    assert where(demand("llamacpp"), node("bare")) == "bare"
    assert process_runs("llamacpp", frozenset()) and not process_runs("vllm", frozenset())


def test_a_gpu_vllm_task_never_lands_on_a_cpu_build() -> None:
    cpu_build_with_cards = node("cpu-build", engines={"vllm": CPU_BUILD}, cards=2)
    gpu_build = node("gpu-build", engines={"vllm": ""}, cards=2)
    assert where(demand(gpus=1), cpu_build_with_cards).startswith("InsufficientResources")
    assert "cards of a vendor" in where(demand(gpus=1), cpu_build_with_cards)
    assert where(demand(gpus=1), cpu_build_with_cards, gpu_build) == "gpu-build"
    # a Docker node's values are image refs: "cpu" there is not a build
    assert not node("d", runtime="docker", engines={"vllm": CPU_BUILD}).cpu_build("vllm")


# --- the agent ---------------------------------------------------------------


def assignment(model: Path, **kw: Any) -> TaskAssignment:
    base: dict[str, Any] = {
        "id": "t-1", "group_id": "g-1", "name": "svc-0", "status": "scheduled",
        "task_type": "inference", "model_name": "tiny", "model_path": str(model),
        "image": "vllm/vllm-openai:latest", "engine": "vllm", "command": [],
        "engine_args": ["--max-model-len", "256"], "env": ["VLLM_CPU_KVCACHE_SPACE=2"],
        "ports": [{"container_port": 8000, "host_port": 20001}], "gpu_ids": [],
        "gpu_required": 0, "memory_mb": 4096, "health_check": {},
        "engine_key": "hfe-secret",
    }
    return TaskAssignment(**{**base, **kw})


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return write_tiny_hf(tmp_path / "models" / TINY_HF_DIR_NAME)


def launch(t: TaskAssignment, models: Path, engines: dict[str, str], python: str) -> Any:
    config = NodeConfig(allowed_volume_prefixes=(str(models),))
    return build_launch(
        t, config, cpu_threads=1, log_dir=models.parent / "logs", host="127.0.0.2",
        engines=engines, vllm_python=python,
    )


@pytest.mark.feature("C14", "C3")
def test_the_agent_launches_the_recipes_argv_with_the_key_in_the_environment(
    model_dir: Path,
) -> None:
    models = model_dir.parent
    spec = launch(assignment(model_dir), models, {"vllm": CPU_BUILD}, "/cache/py")
    expected = process_argv(
        cpu_shape(model_path=str(model_dir), served_model_name="tiny"), "/cache/py"
    )
    assert list(spec.argv) == expected
    assert "hfe-secret" not in " ".join(spec.argv)  # C14: never on the command line
    assert spec.env["VLLM_API_KEY"] == "hfe-secret"
    assert spec.env["VLLM_CPU_KVCACHE_SPACE"] == "2"  # the task's, over the default
    assert spec.env["HF_HUB_OFFLINE"] == "1" and spec.host_ports == (20001,)


def test_the_agent_refuses_vllm_it_cannot_run(model_dir: Path) -> None:
    models = model_dir.parent
    t = assignment(model_dir)
    with pytest.raises(LaunchFailed, match="needs a container runtime"):
        launch(t, models, {"llamacpp": ""}, "")
    with pytest.raises(LaunchFailed, match="CPU build, which drives no card"):
        launch(replace_gpus(t), models, {"vllm": CPU_BUILD}, "/cache/py")
    with pytest.raises(LaunchFailed, match="downloads nothing"):
        launch(assignment(Path("org/some-model")), models, {"vllm": CPU_BUILD}, "/cache/py")
    with pytest.raises(LaunchFailed, match="outside the allowed volume prefixes of this node"):
        launch(assignment(Path("/etc")), models, {"vllm": CPU_BUILD}, "/cache/py")
    (models / "empty").mkdir()
    with pytest.raises(LaunchFailed, match=r"no config\.json"):
        launch(assignment(models / "empty"), models, {"vllm": CPU_BUILD}, "/cache/py")
    with pytest.raises(LaunchFailed, match="may not set --port"):
        launch(assignment(model_dir, engine_args=["--port", "1"]), models,
               {"vllm": CPU_BUILD}, "/cache/py")


def replace_gpus(t: TaskAssignment) -> TaskAssignment:
    return t.model_copy(update={"gpu_required": 1, "gpu_ids": [0]})


def fake_python(tmp_path: Path, prints: str) -> str:
    script = tmp_path / f"python-{prints or 'none'}"
    script.write_text(f"#!/bin/sh\necho {prints}\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


@pytest.mark.feature("C1")
def test_the_agent_reports_vllm_with_its_build_only_when_its_python_has_it(
    tmp_path: Path,
) -> None:
    assert vllm_build(fake_python(tmp_path, "vllm-cpu")) == CPU_BUILD
    assert vllm_build(fake_python(tmp_path, "vllm")) == ""
    assert vllm_build(fake_python(tmp_path, "")) is None
    assert vllm_build(str(tmp_path / "missing")) is None
    assert "vllm" not in local_engines("")
    assert local_engines(fake_python(tmp_path, "vllm-cpu"))["vllm"] == CPU_BUILD
