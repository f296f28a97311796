"""Where an engine starts with its own sleep mode (core.engines.sleep), decided once for
the recipe (the container the agent launches and the dry run shows) and the agent."""

from __future__ import annotations

import pytest

from heteroflow.core.engines.commands import SLEEP_MODE_FLAG
from heteroflow.core.engines.sleep import keep_fits, sleep_mode
from heteroflow.core.ports import PortMapping
from heteroflow.core.recipe import NodeShape, TaskShape, container_plan


def plan_of(
    engine: str, image: str, vendor: str, gpus: int = 1, version: str = ""
) -> tuple[tuple[str, ...], dict[str, str]]:
    task = TaskShape(
        id="task-1", group_id="tg-1", name="svc-0", image=image, engine=engine,
        model_path="/data/models/m", model_name="m", ports=(PortMapping(8000, 21000),),
        gpu_required=gpus, gpu_ids=tuple(range(gpus)), engine_version=version,
    )
    node = NodeShape(address="10.0.0.7", card_vendors={i: vendor for i in range(gpus)})
    plan = container_plan(task, node, work_dir_config="/w/config").plan
    return plan.command, dict(plan.env)


@pytest.mark.feature("F1")
def test_vllm_on_cuda_cards_starts_with_its_sleep_mode_and_dev_routes() -> None:
    args, env = plan_of("vllm", "vllm/vllm-openai:v0.11.2", "nvidia", version="0.11.2")
    assert SLEEP_MODE_FLAG in args
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # its /sleep and /wake_up routes


@pytest.mark.feature("F1")
@pytest.mark.parametrize(
    ("engine", "image", "vendor", "gpus", "version", "why"),
    [
        ("vllm", "vllm/vllm-openai:v0.6.3", "nvidia", 1, "0.6.3", "predates the /sleep routes"),
        ("vllm", "vllm/vllm-openai:latest", "amd", 1, "", "not amd"),
        ("vllm-mtt", "mthreads/vllm:latest", "musa", 1, "", "Moore Threads"),
        ("sglang", "lmsysorg/sglang:latest", "nvidia", 1, "", "sglang has no sleep mode"),
        ("llamacpp", "ghcr.io/ggml-org/llama.cpp:server", "nvidia", 1, "", "no sleep mode"),
    ],
)
def test_elsewhere_the_engine_starts_without_it_and_the_reason_is_said(
    engine: str, image: str, vendor: str, gpus: int, version: str, why: str
) -> None:
    args, env = plan_of(engine, image, vendor, gpus, version)
    assert SLEEP_MODE_FLAG not in args
    # the development routes the agent calls (F1's /sleep?level=2 before a stop) on every
    # vLLM-family engine, never on another
    assert ("VLLM_SERVER_DEV_MODE" in env) == engine.startswith("vllm")
    mode = sleep_mode(engine, vendor, version)
    assert not mode.kept and why in mode.reason
    assert mode.words().startswith("engine stopped (") and why in mode.words()


@pytest.mark.feature("F1")
def test_the_cpu_build_refuses_sleep_mode_so_it_is_never_asked_for() -> None:
    mode = sleep_mode("vllm", "")
    assert not mode.kept and "CPU build refuses --enable-sleep-mode" in mode.reason
    assert sleep_mode("vllm", "nvidia", "latest").kept  # a tag that is no version: current


def test_a_kept_sleep_needs_the_weights_to_fit_in_free_host_memory() -> None:
    gib = 1024**3
    assert keep_fits(10 * gib, 12 * gib)
    assert not keep_fits(10 * gib, 10 * gib)  # no headroom left
