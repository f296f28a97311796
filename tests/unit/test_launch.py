"""From task assignment to process launch: environment, llama.cpp argv, refusals."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.launch import AGENT_OWNED_ENV, build_launch, host_port_for, task_env
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.engines.llamacpp_server import LaunchArgsError, parse_args
from heteroflow.schemas.nodes import TaskAssignment


def assignment(**overrides: Any) -> TaskAssignment:
    base: dict[str, Any] = {
        "id": "task-1",
        "group_id": "group-1",
        "name": "gemma-0",
        "status": "starting",
        "task_type": "inference",
        "model_name": "gemma",
        "model_path": "tiny",
        "image": "ghcr.io/ggml-org/llama.cpp:server",
        "engine": "llamacpp",
        "command": [],
        "engine_args": [],
        "env": [],
        "ports": [{"container_port": 8080, "host_port": 30001}],
        "gpu_ids": [],
        "gpu_required": 0,
        "memory_mb": 1024,
        "health_check": {},
    }
    base.update(overrides)
    return TaskAssignment(**base)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "models"
    d.mkdir()
    (d / "tiny.gguf").write_bytes(b"GGUF")
    return d


@pytest.fixture
def config(model_dir: Path) -> NodeConfig:
    return NodeConfig.from_dict({"allowed_volume_prefixes": [str(model_dir)]})


# --- environment -----------------------------------------------------------------------------


@pytest.mark.feature("C3")
def test_task_env_drops_bare_names_and_keeps_values_with_equals() -> None:
    env = task_env(assignment(env=["BARE", "A=1", "B=x=y", "EMPTY=", "=nameless"]))
    assert "BARE" not in env
    assert env["A"] == "1"
    assert env["B"] == "x=y"  # split on the first '=' only
    assert env["EMPTY"] == ""
    assert "" not in env


@pytest.mark.feature("C3")
@pytest.mark.parametrize("name", sorted(AGENT_OWNED_ENV))
def test_task_env_drops_user_values_for_agent_owned_names(name: str) -> None:
    env = task_env(assignment(env=[f"{name}=user-value"], gpu_ids=[3]))
    assert env.get(name) != "user-value"


@pytest.mark.feature("C3")
def test_task_env_sets_agent_variables() -> None:
    t = assignment(
        env=["CUDA_VISIBLE_DEVICES=7", "HETEROFLOW_TASK_ID=spoof", "KEEP=me"], gpu_ids=[2, 0, 5]
    )
    env = task_env(t)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,0,5"
    assert env["HETEROFLOW_TASK_ID"] == "task-1"
    assert env["HETEROFLOW_GROUP_ID"] == "group-1"
    assert env["HETEROFLOW_TASK_NAME"] == "gemma-0"
    assert env["KEEP"] == "me"
    assert "NVIDIA_VISIBLE_DEVICES" not in env


@pytest.mark.feature("C3")
@pytest.mark.parametrize(
    "item",
    [
        "LD_PRELOAD=/tmp/evil.so",
        "LD_LIBRARY_PATH=/tmp",
        "PYTHONWARNINGS=ignore::0:os.system('id'):0",
        "PYTHONSTARTUP=/tmp/x.py",
        "PYTHONPATH=/tmp",
        "BROWSER=/bin/sh -c id",
        "http_proxy=http://attacker:3128",
        "HTTPS_PROXY=http://attacker:3128",
        "NODE_OPTIONS=--require /tmp/x.js",
        "BASH_ENV=/tmp/x.sh",
        "PATH=/tmp",
        "HETEROFLOW_ADMIN_PASSWORD=x",
        "NVIDIA_DRIVER_CAPABILITIES=all",
        "BAD NAME=1",
    ],
)
def test_the_agent_drops_denied_variables_whatever_the_server_let_through(item: str) -> None:
    """The node's own line (issue 10): a row written before the create-time rule, or by
    a compromised server, still cannot reach the loader or an interpreter's start-up."""
    name = item.split("=", 1)[0]
    env = task_env(assignment(env=[item, "VLLM_LOGGING_LEVEL=DEBUG"]))
    assert env.get(name) != item.split("=", 1)[1]
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"


def test_an_engine_process_starts_from_a_clean_environment(
    config: NodeConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attack (issue 10): the admin password was readable in /proc/<engine>/environ
    because engines inherited the agent's (and in ``up`` the server's) environment."""
    monkeypatch.setenv("HETEROFLOW_ADMIN_PASSWORD", "s3cret-admin")
    monkeypatch.setenv("HETEROFLOW_AGENT_NODE_TOKEN", "s3cret-token")
    spec = build_launch(assignment(env=["OMP_NUM_THREADS=1"]), config, cpu_threads=0,
                        log_dir=tmp_path)
    assert not any("s3cret" in v for v in spec.env.values())
    assert set(spec.env) == {
        "PATH", "LANG", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
        "HETEROFLOW_TASK_ID", "HETEROFLOW_GROUP_ID", "HETEROFLOW_TASK_NAME",
    }


def test_task_env_cpu_task_hides_all_gpus() -> None:
    env = task_env(assignment(gpu_ids=[], env=["CUDA_VISIBLE_DEVICES=0,1"]))
    assert env["CUDA_VISIBLE_DEVICES"] == ""


# --- llama.cpp argv --------------------------------------------------------------------------


def test_build_launch_llamacpp_argv(config: NodeConfig, model_dir: Path, tmp_path: Path) -> None:
    t = assignment(engine_args=["-c", "2048", "--embeddings"])
    spec = build_launch(t, config, cpu_threads=0, log_dir=tmp_path / "logs")
    model = str((model_dir / "tiny.gguf").resolve())
    assert list(spec.argv) == [
        sys.executable,
        "-m",
        "heteroflow.engines.llamacpp_server",
        "-m",
        model,
        "--host",
        ENGINE_ADDRESS,
        "--port",
        "30001",
        "--alias",
        "gemma",
        "-ngl",
        "0",  # a CPU task offloads no layer
        "--metrics",
        "--jinja",
        "-c",
        "2048",
        "--embeddings",
    ]
    assert spec.task_id == "task-1"
    assert spec.host_ports == (30001,)
    assert spec.log_path == tmp_path / "logs" / "task-1.log"
    assert spec.env["HETEROFLOW_TASK_ID"] == "task-1"
    assert "PORT" not in spec.env


def test_build_launch_argv_is_accepted_by_the_launchers_parser(
    config: NodeConfig, model_dir: Path, tmp_path: Path
) -> None:
    t = assignment(engine_args=["-c", "2048", "-ngl", "0", "--embeddings", "-np", "2"])
    spec = build_launch(t, config, cpu_threads=3, log_dir=tmp_path)
    parsed = parse_args(list(spec.argv[3:]))
    assert parsed.model == str((model_dir / "tiny.gguf").resolve())
    assert parsed.host == ENGINE_ADDRESS
    assert parsed.port == 30001
    assert parsed.aliases == ("gemma",)
    assert parsed.threads == 3
    assert parsed.ctx_size == 2048
    assert parsed.gpu_layers == 0
    assert parsed.embedding is True
    assert parsed.parallel == 2


def test_parser_check_is_not_vacuous() -> None:
    with pytest.raises(LaunchArgsError):
        parse_args(["-m", "/x.gguf", "--threads=4"])


def test_cpu_threads_added_when_not_given(config: NodeConfig, tmp_path: Path) -> None:
    spec = build_launch(assignment(), config, cpu_threads=4, log_dir=tmp_path)
    argv = list(spec.argv)
    assert argv[-2:] == ["-t", "4"]
    assert argv.count("-t") == 1


def test_cpu_threads_zero_adds_nothing(config: NodeConfig, tmp_path: Path) -> None:
    spec = build_launch(assignment(), config, cpu_threads=0, log_dir=tmp_path)
    assert "-t" not in spec.argv
    assert "--threads" not in spec.argv


@pytest.mark.parametrize("flag", ["-t", "--threads"])
def test_user_threads_flag_wins(config: NodeConfig, tmp_path: Path, flag: str) -> None:
    spec = build_launch(
        assignment(engine_args=[flag, "2"]), config, cpu_threads=8, log_dir=tmp_path
    )
    argv = list(spec.argv)
    assert "8" not in argv
    assert argv[-2:] == [flag, "2"]
    assert argv.count("-t") + argv.count("--threads") == 1
    assert parse_args(argv[3:]).threads == 2


def test_port_is_first_mapping(config: NodeConfig, tmp_path: Path) -> None:
    t = assignment(
        ports=[
            {"container_port": 8080, "host_port": 30005},
            {"container_port": 9090, "host_port": 30006},
        ]
    )
    spec = build_launch(t, config, cpu_threads=0, log_dir=tmp_path)
    argv = list(spec.argv)
    assert argv[argv.index("--port") + 1] == "30005"
    assert spec.host_ports == (30005, 30006)
    assert host_port_for(t, 9090) == 30006
    with pytest.raises(LaunchFailed, match="1234"):
        host_port_for(t, 1234)


def test_task_without_ports_fails(config: NodeConfig, tmp_path: Path) -> None:
    with pytest.raises(LaunchFailed, match="no mapping"):
        build_launch(assignment(ports=[]), config, cpu_threads=0, log_dir=tmp_path)


# --- refusals and custom commands ------------------------------------------------------------


@pytest.mark.parametrize("engine", ["vllm", "sglang", "trtllm", ""])
def test_container_only_engine_fails_under_process_runtime(
    config: NodeConfig, tmp_path: Path, engine: str
) -> None:
    t = assignment(engine=engine, image="vllm/vllm-openai")
    with pytest.raises(LaunchFailed, match="container runtime") as exc:
        build_launch(t, config, cpu_threads=0, log_dir=tmp_path)
    assert (engine or "(none)") in str(exc.value)


@pytest.mark.parametrize("command", [["/bin/sh", "-c", "id; env"], ["true"]])
def test_the_process_runtime_never_runs_a_custom_command(
    config: NodeConfig, tmp_path: Path, command: list[str]
) -> None:
    """Attack (issue 10): a member's task.command would run on the host as the agent's
    user; the process runtime refuses it whatever the engine or model path."""
    t = assignment(engine="llamacpp", command=command, model_path="/definitely/not/allowed")
    with pytest.raises(LaunchFailed, match=r"never runs a custom task\.command"):
        build_launch(t, config, cpu_threads=0, log_dir=tmp_path)


def test_model_outside_allow_list_fails(config: NodeConfig, tmp_path: Path) -> None:
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF")
    with pytest.raises(LaunchFailed, match="outside"):
        build_launch(assignment(model_path=str(outside)), config, cpu_threads=0, log_dir=tmp_path)


def test_missing_model_fails(config: NodeConfig, tmp_path: Path) -> None:
    with pytest.raises(LaunchFailed, match="not found"):
        build_launch(assignment(model_path="nope"), config, cpu_threads=0, log_dir=tmp_path)


def test_denied_prefix_from_config_applies(model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "private").mkdir()
    (model_dir / "private" / "p.gguf").write_bytes(b"GGUF")
    cfg = NodeConfig.from_dict(
        {
            "allowed_volume_prefixes": [str(model_dir)],
            "denied_volume_prefixes": [str(model_dir / "private")],
        }
    )
    t = assignment(model_path=str(model_dir / "private" / "p.gguf"))
    with pytest.raises(LaunchFailed, match="denied"):
        build_launch(t, cfg, cpu_threads=0, log_dir=tmp_path)


# --- NodeConfig ------------------------------------------------------------------------------


def test_node_config_from_dict_reads_prefixes_and_labels() -> None:
    cfg = NodeConfig.from_dict(
        {
            "allowed_volume_prefixes": ["/data/models/", "/srv/m"],
            "denied_volume_prefixes": ["/data/models/private"],
            "labels": {"zone": "a", "n": 1},
            "gpus": [{"vendor": "nvidia", "model": "A10", "memory_mb": 24576}],
        }
    )
    assert cfg.allowed_volume_prefixes == ("/data/models", "/srv/m")
    assert cfg.denied_volume_prefixes == ("/data/models/private",)
    assert cfg.labels == {"zone": "a", "n": "1"}
    assert len(cfg.gpus) == 1


def test_node_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown key"):
        NodeConfig.from_dict({"allowed_volume_prefix": ["/data/models"]})


@pytest.mark.parametrize("key", ["allowed_volume_prefixes", "denied_volume_prefixes"])
@pytest.mark.parametrize("bad", ["models", "./models", "", 5])
def test_node_config_rejects_relative_prefixes(key: str, bad: object) -> None:
    with pytest.raises(ValueError, match="absolute path"):
        NodeConfig.from_dict({key: ["/ok", bad]})


def test_node_config_load(tmp_path: Path) -> None:
    p = tmp_path / "agent.json"
    p.write_text('{"allowed_volume_prefixes": ["/m"], "labels": {"zone": "b"}}')
    cfg = NodeConfig.load(p)
    assert cfg.allowed_volume_prefixes == ("/m",)
    assert cfg.labels == {"zone": "b"}
    assert NodeConfig.load(None) == NodeConfig()


# --- agent-owned flags and names -------------------------------------------------------------


def test_model_name_with_comma_is_one_alias_or_refused(config: NodeConfig, tmp_path: Path) -> None:
    t = assignment(model_name="org,model")
    try:
        spec = build_launch(t, config, cpu_threads=0, log_dir=tmp_path)
    except LaunchFailed:
        return
    assert parse_args(list(spec.argv[3:])).aliases == ("org,model",)


@pytest.mark.parametrize(
    ("engine_args", "field"),
    [
        (["-m", "OUTSIDE"], "model"),
        (["--model", "OUTSIDE"], "model"),
        (["--host", "0.0.0.0"], "host"),
        (["--port", "1"], "port"),
    ],
)
def test_engine_args_cannot_override_agent_owned_flags(
    config: NodeConfig, model_dir: Path, tmp_path: Path, engine_args: list[str], field: str
) -> None:
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(b"GGUF")
    args = [str(outside) if a == "OUTSIDE" else a for a in engine_args]
    t = assignment(engine_args=args)
    try:
        spec = build_launch(t, config, cpu_threads=0, log_dir=tmp_path)
    except LaunchFailed:
        return
    parsed = parse_args(list(spec.argv[3:]))
    expected = {
        "model": str((model_dir / "tiny.gguf").resolve()),
        "host": ENGINE_ADDRESS,
        "port": 30001,
    }
    assert getattr(parsed, field) == expected[field]


def test_an_engine_listens_on_the_nodes_private_loopback(
    config: NodeConfig, tmp_path: Path
) -> None:
    """C14: never on the node's address, where only its door listens; its port is
    checked where it listens."""
    spec = build_launch(assignment(), config, cpu_threads=0, log_dir=tmp_path)
    argv = list(spec.argv)
    assert argv[argv.index("--host") + 1] == ENGINE_ADDRESS and spec.host == ENGINE_ADDRESS


def test_the_engine_key_reaches_the_engine_in_its_environment_only(
    config: NodeConfig, tmp_path: Path
) -> None:
    # a task's own value for the variable is dropped: only the agent sets it
    t = assignment(env=["LLAMA_API_KEY=mine"]).model_copy(update={"engine_key": "hfe-secret"})
    spec = build_launch(t, config, cpu_threads=0, log_dir=tmp_path)
    assert spec.env["LLAMA_API_KEY"] == "hfe-secret"
    assert not any("hfe-secret" in a for a in spec.argv)
    assert "hfe-secret" not in repr(t)
