"""Exact command lines per engine and shape, checked against each engine's real CLI.

Golden argv are literal tuples (H4, H3, G1, G2); every emitted flag must be in the
engine's pinned flag list of ``core/engines/flags.py`` (transcribed from the engine's docs
or source); llama.cpp argv must parse with our launcher; the vLLM KV-offload version table
(C12) and the vLLM-only sleep variable (C3) are pinned too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from heteroflow.core.engines import (
    ENGINES,
    CommandError,
    EngineCommand,
    LaunchShape,
    build_command,
    process_argv,
)
from heteroflow.core.engines.flags import (
    ACCEPTED_FLAGS,
    MINDIE_CONFIG_KEYS,
    accepted_flags,
)
from heteroflow.core.engines.kv_offload import kv_offload_args
from heteroflow.core.engines.mindie import CONFIG_PATH, START_SCRIPT
from heteroflow.engines.llamacpp_server import parse_args

M = "/models/qwen"
BASE = {"model_path": M, "served_model_name": "qwen", "port": 8000}
VLLM_SERVE = ("vllm", "serve")
SGLANG = ("python3", "-m", "sglang.launch_server")
# issue 15: the tool-call parser of the model's family ("qwen" in the path: Hermes format)
VLLM_TOOLS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
SGLANG_TOOLS = ("--tool-call-parser", "qwen25")
LLAMACPP_CTX = ("-c", "4096")  # the context the platform passes when a task sets none


def shape(engine: str, **kw: Any) -> LaunchShape:
    return LaunchShape(engine=engine, **{**BASE, **kw})


def tp(engine: str, n: int = 2, **kw: Any) -> LaunchShape:
    return shape(engine, parallelism="tensor_parallel", gpus=n, tensor_parallel_size=n, **kw)


def stage(engine: str, rank: int, **kw: Any) -> LaunchShape:
    return shape(
        engine,
        parallelism="pipeline",
        gpus=2,
        tensor_parallel_size=2,
        pipeline_parallel_size=2,
        pipeline_rank=rank,
        master_addr="10.0.0.1",
        **kw,
    )


# fmt: off
GOLDEN: list[tuple[str, LaunchShape, tuple[str, ...] | None, tuple[str, ...]]] = [
    ("vllm-single", shape("vllm"), ("vllm", "serve"),
     (M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9", *VLLM_TOOLS)),
    ("vllm-tp", tp("vllm", gpu_memory_utilization=35), ("vllm", "serve"),
     (M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.35", *VLLM_TOOLS)),
    ("vllm-split", shape("vllm", parallelism="split"), ("vllm", "serve"),
     (M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9", *VLLM_TOOLS)),
    ("vllm-pipeline-rank0", stage("vllm", 0), ("vllm", "serve"),
     (M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "2",
      "--node-rank", "0", "--master-addr", "10.0.0.1", "--gpu-memory-utilization", "0.9",
      *VLLM_TOOLS)),
    ("vllm-pipeline-rank1", stage("vllm", 1), ("vllm", "serve"),
     (M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "2",
      "--node-rank", "1", "--master-addr", "10.0.0.1", "--headless", "--gpu-memory-utilization",
      "0.9")),
    ("vllm-before-the-vllm-cli", shape("vllm", engine_version="0.4.2"),
     ("python3", "-m", "vllm.entrypoints.openai.api_server"),
     ("--model", M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9", *VLLM_TOOLS)),
    ("vllm-mtt-tp", tp("vllm-mtt"), ("vllm", "serve"),
     (M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.9", *VLLM_TOOLS)),
    ("vllm-mtt-pipeline-rank0", stage("vllm-mtt", 0), ("vllm", "serve"),
     (M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--nnodes", "2",
      "--node-rank", "0", "--master-addr", "10.0.0.1", "--gpu-memory-utilization", "0.9",
      *VLLM_TOOLS)),
    ("sglang-single", shape("sglang"), ("python3", "-m", "sglang.launch_server"),
     ("--model-path", M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tp-size", "1", "--mem-fraction-static", "0.9", "--enable-metrics", *SGLANG_TOOLS)),
    ("sglang-tp", tp("sglang", 4, gpu_memory_utilization=80),
     ("python3", "-m", "sglang.launch_server"),
     ("--model-path", M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tp-size", "4", "--mem-fraction-static", "0.8", "--enable-metrics", *SGLANG_TOOLS)),
    ("sglang-split", shape("sglang", parallelism="split"),
     ("python3", "-m", "sglang.launch_server"),
     ("--model-path", M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tp-size", "1", "--mem-fraction-static", "0.9", "--enable-metrics", *SGLANG_TOOLS)),
    ("sglang-pipeline-rank1", stage("sglang", 1), ("python3", "-m", "sglang.launch_server"),
     ("--model-path", M, "--host", "0.0.0.0", "--port", "8000", "--served-model-name", "qwen",
      "--tp-size", "2", "--mem-fraction-static", "0.9", "--enable-metrics", "--pp-size", "2",
      "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:50000",
      *SGLANG_TOOLS)),
    ("llamacpp-single", shape("llamacpp"), None,
     ("-m", M, "--host", "0.0.0.0", "--port", "8000", "--alias", "qwen", "-ngl", "999",
      "--metrics", "--jinja", *LLAMACPP_CTX)),
    ("llamacpp-cpu", shape("llamacpp", gpus=0), None,
     ("-m", M, "--host", "0.0.0.0", "--port", "8000", "--alias", "qwen", "-ngl", "0", "--metrics",
      "--jinja", *LLAMACPP_CTX)),
    ("llamacpp-tp", tp("llamacpp"), None,
     ("-m", M, "--host", "0.0.0.0", "--port", "8000", "--alias", "qwen", "-ngl", "999",
      "--tensor-split", "1,1", "--metrics", "--jinja", *LLAMACPP_CTX)),
    ("llamacpp-tp-proportions", tp("llamacpp", 3, tensor_split=(3.0, 1.0, 0.5)), None,
     ("-m", M, "--host", "0.0.0.0", "--port", "8000", "--alias", "qwen", "-ngl", "999",
      "--tensor-split", "3,1,0.5", "--metrics", "--jinja", *LLAMACPP_CTX)),
    ("llamacpp-split", shape("llamacpp", parallelism="split"), None,
     ("-m", M, "--host", "0.0.0.0", "--port", "8000", "--alias", "qwen", "-ngl", "999",
      "--metrics", "--jinja", *LLAMACPP_CTX)),
    ("trtllm-single", shape("trtllm"), ("trtllm-serve",),
     (M, "--host", "0.0.0.0", "--port", "8000", "--backend", "trt")),
    ("trtllm-tp", tp("trtllm"), ("trtllm-serve",),
     (M, "--host", "0.0.0.0", "--port", "8000", "--backend", "trt", "--tp_size", "2")),
    ("trtllm-split", shape("trtllm", parallelism="split"), ("trtllm-serve",),
     (M, "--host", "0.0.0.0", "--port", "8000", "--backend", "trt")),
    ("trtllm-0.x-has-no-trt-backend-choice", shape("trtllm", engine_version="0.17.0"),
     ("trtllm-serve",),
     (M, "--host", "0.0.0.0", "--port", "8000")),
    ("mindie-single", shape("mindie"), ("/bin/bash", "-c"),
     (START_SCRIPT,)),
    ("mindie-tp", tp("mindie", 4), ("/bin/bash", "-c"),
     (START_SCRIPT,)),
    ("mindie-split", shape("mindie", parallelism="split"), ("/bin/bash", "-c"),
     (START_SCRIPT,)),
]
# fmt: on


@pytest.mark.feature("H4")
@pytest.mark.parametrize(
    ("s", "entrypoint", "args"), [g[1:] for g in GOLDEN], ids=[g[0] for g in GOLDEN]
)
def test_golden_command_lines(
    s: LaunchShape, entrypoint: tuple[str, ...] | None, args: tuple[str, ...]
) -> None:
    command = build_command(s)
    assert command.entrypoint == entrypoint
    assert command.args == args


def flags_of(command: EngineCommand) -> Iterator[str]:
    return (a for a in command.args if a.startswith("-"))


VARIANTS = [g[1] for g in GOLDEN] + [
    shape("vllm", sleep_mode=True, kv_offload_gb=8, engine_version="0.11.2"),
    shape("vllm", kv_offload_gb=8, engine_version="0.6.3.post1"),
    shape("vllm-mtt", sleep_mode=True, embeddings=True),
    shape("sglang", embeddings=True),
    shape("llamacpp", embeddings=True),
    tp("trtllm", 4, engine_version="1.0.0"),
]


@pytest.mark.feature("H4")
@pytest.mark.parametrize("s", VARIANTS, ids=lambda s: s.engine)
def test_every_emitted_flag_is_one_the_engine_accepts(s: LaunchShape) -> None:
    accepted = accepted_flags(s.engine)
    unknown = [flag for flag in flags_of(build_command(s)) if flag not in accepted]
    assert unknown == [], f"{s.engine} does not accept {unknown}"


@pytest.mark.feature("H4")
def test_accepted_flag_lists_name_their_source_and_pin() -> None:
    assert {entry.engine for entry in ACCEPTED_FLAGS} == set(ENGINES)
    for entry in ACCEPTED_FLAGS:
        assert entry.version and entry.source
        assert all(flag.startswith("-") for flag in entry.flags)


def walk_keys(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for key, child in value.items():
            yield key
            yield from walk_keys(child)
    elif isinstance(value, list):
        for child in value:
            yield from walk_keys(child)


@pytest.mark.feature("H4")
def test_mindie_is_configured_by_a_documented_config_file() -> None:
    command = build_command(
        tp("mindie", 4, served_model_name="qwen2-7b", gpu_memory_utilization=80)
    )
    assert set(command.config_files) == {CONFIG_PATH}
    config = json.loads(command.config_files[CONFIG_PATH])
    assert set(walk_keys(config)) <= MINDIE_CONFIG_KEYS
    server, backend = config["ServerConfig"], config["BackendConfig"]
    assert (server["ipAddress"], server["port"], server["managementPort"]) == (
        "0.0.0.0",
        8000,
        8000,
    )
    assert server["allowAllZeroIpListening"] is True and server["httpsEnabled"] is False
    assert backend["npuDeviceIds"] == [[0, 1, 2, 3]]
    [model] = backend["ModelDeployConfig"]["ModelConfig"]
    assert (model["modelName"], model["modelWeightPath"], model["worldSize"]) == ("qwen2-7b", M, 4)
    assert command.env["MIES_CONFIG_JSON_PATH"] == CONFIG_PATH
    assert command.env["NPU_MEMORY_FRACTION"] == "0.8"
    assert "VLLM_SERVER_DEV_MODE" not in command.env


LLAMA_GOLDEN = [g[1] for g in GOLDEN if g[1].engine == "llamacpp"]


@pytest.mark.feature("H4")
@pytest.mark.parametrize("s", [*LLAMA_GOLDEN, shape("llamacpp", embeddings=True)])
def test_llamacpp_args_parse_with_our_launcher(s: LaunchShape) -> None:
    config = parse_args(list(build_command(s).args))
    assert (config.model, config.host, config.port, config.aliases) == (
        M,
        "0.0.0.0",
        8000,
        ("qwen",),
    )
    assert config.gpu_layers == (999 if s.gpus else 0)
    assert config.tensor_split == (s.tensor_split or ((1.0,) * s.gpus if s.gpus > 1 else ()))
    assert config.metrics and config.embedding == s.embeddings


@pytest.mark.feature("H4")
def test_process_runtime_runs_llamacpp_through_the_launcher() -> None:
    argv = process_argv(shape("llamacpp", gpus=0, host="127.0.0.1", port=30001), "/venv/python")
    assert argv[:3] == ["/venv/python", "-m", "heteroflow.engines.llamacpp_server"]
    config = parse_args(argv[3:])
    assert (config.host, config.port, config.gpu_layers) == ("127.0.0.1", 30001, 0)
    with pytest.raises(CommandError, match="needs a container runtime"):
        process_argv(shape("sglang"), "/venv/python")  # vLLM: tests/unit/test_vllm_process


@pytest.mark.feature("H3")
@pytest.mark.parametrize("engine", ["mindie", "trtllm", "llamacpp"])
def test_engines_without_pipeline_refuse_it(engine: str) -> None:
    with pytest.raises(CommandError, match=f"{engine} does not support parallelism 'pipeline'"):
        build_command(stage(engine, 0))


@pytest.mark.feature("C3")
@pytest.mark.parametrize("engine", list(ENGINES))
def test_vllm_server_dev_mode_for_the_vllm_family_only_and_sleep_mode_where_asked(
    engine: str,
) -> None:
    asleep = build_command(shape(engine, sleep_mode=True))
    plain = build_command(shape(engine))
    family = engine in ("vllm", "vllm-mtt")
    # the routes the agent calls over the loopback (the spec: injected into vLLM only)
    assert ("VLLM_SERVER_DEV_MODE" in asleep.env) == family
    assert ("VLLM_SERVER_DEV_MODE" in plain.env) == family
    assert "--enable-sleep-mode" not in plain.args
    if family:
        assert asleep.env["VLLM_SERVER_DEV_MODE"] == plain.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert "--enable-sleep-mode" in asleep.args


@pytest.mark.feature("H4")
@pytest.mark.parametrize(
    ("percent", "fraction"), [(90, "0.9"), (35, "0.35"), (100, "1"), (5, "0.05")]
)
def test_gpu_memory_utilization_is_passed_as_a_fraction(percent: int, fraction: str) -> None:
    vllm = build_command(shape("vllm", gpu_memory_utilization=percent)).args
    assert vllm[vllm.index("--gpu-memory-utilization") + 1] == fraction
    sglang = build_command(shape("sglang", gpu_memory_utilization=percent)).args
    assert sglang[sglang.index("--mem-fraction-static") + 1] == fraction


NATIVE = ("--kv-offloading-size", "16", "--kv-offloading-backend", "native")


@pytest.mark.feature("C12")
@pytest.mark.parametrize(
    ("version", "tp_size", "expected"),
    [
        ("0.6.3.post1", 1, ("--swap-space", "16")),
        ("0.7.3", 2, ("--swap-space", "8")),
        ("v0.5.4", 3, ("--swap-space", "5.333")),
        ("0.11.1", 1, NATIVE),
        ("0.11.2", 4, NATIVE),  # total over the TP ranks, not per GPU
        ("v0.12.0", 1, NATIVE),
        ("0.13.0+cu129", 1, NATIVE),
    ],
)
def test_kv_offload_flag_form_per_version(
    version: str, tp_size: int, expected: tuple[str, ...]
) -> None:
    assert kv_offload_args(version, 16, tensor_parallel_size=tp_size) == expected


@pytest.mark.feature("C12")
@pytest.mark.parametrize(
    "version",
    ["0.8.0rc1", "0.8.0", "0.9.2", "0.10.2+cu128", "0.11.0", "0.11.0.post1", "0.11.1rc2"],
)
def test_kv_offload_refuses_the_range_that_silently_ignores_it(version: str) -> None:
    with pytest.raises(CommandError, match=re.escape("0.8.0-0.11.0")):
        kv_offload_args(version, 16)


@pytest.mark.feature("C12")
def test_kv_offload_bounds_and_unreadable_versions() -> None:
    assert kv_offload_args("0.12.0", 1)[1] == "1"
    assert kv_offload_args("0.12.0", 4096)[1] == "4096"
    for gb in (0, 4097, -1):
        with pytest.raises(CommandError, match="1-4096"):
            kv_offload_args("0.12.0", gb)
    for version in ("", "latest", "0", "nightly-0.11.2"):
        with pytest.raises(CommandError, match="cannot read engine version"):
            kv_offload_args(version, 8)


@pytest.mark.feature("C12")
def test_kv_offload_through_the_builder() -> None:
    args = build_command(tp("vllm", kv_offload_gb=16, engine_version="0.11.2")).args
    assert args[-4:] == NATIVE
    for bad, why in [
        (shape("sglang", kv_offload_gb=8, engine_version="0.11.2"), "vLLM only"),
        (shape("vllm-mtt", kv_offload_gb=8, engine_version="0.28.0"), "vLLM only"),
        (stage("vllm", 0, kv_offload_gb=8, engine_version="0.11.2"), "pipeline"),
        (shape("vllm", kv_offload_gb=8), "engine_version"),
        (shape("vllm", kv_offload_gb=8, engine_version="0.9.2"), "0.8.0-0.11.0"),
    ]:
        with pytest.raises(CommandError, match=re.escape(why)):
            build_command(bad)


@pytest.mark.feature("H4")
def test_embeddings_extra_args_and_model_name_rules() -> None:
    assert build_command(shape("sglang", embeddings=True)).args[-1] == "--is-embedding"
    llama = build_command(shape("llamacpp", embeddings=True)).args
    assert llama[-3:] == ("--embeddings", *LLAMACPP_CTX)
    extra = ("--max-model-len", "4096")
    assert build_command(shape("vllm", extra_args=extra)).args[-2:] == extra


@pytest.mark.feature("H4")
@pytest.mark.parametrize(
    ("s", "why"),
    [
        (shape("vllm", model_path=""), "model_path is empty"),
        (shape("tgi"), "unknown engine"),
        (shape("vllm", gpus=2), "must equal the container's gpus"),
        (shape("vllm", gpus=2, tensor_parallel_size=2), "single runs on at most one card"),
        (tp("vllm", 1), "at least two cards"),
        (replace(stage("vllm", 0), master_addr=""), "master_addr"),
        (replace(stage("vllm", 0), pipeline_rank=2), "pipeline_rank 2"),
        (shape("vllm", pipeline_parallel_size=2), "takes no pipeline stages"),
        (shape("sglang", gpus=0), "needs at least one GPU"),  # vLLM: its CPU build
        (shape("vllm", gpu_memory_utilization=0), "1-100"),
        (shape("vllm", gpu_memory_utilization=101), "1-100"),
        (shape("vllm", port=0), "port 0"),
        (shape("vllm", extra_args=("--port=9000",)), "may not set --port=9000"),
        (shape("llamacpp", extra_args=("--alias", "x")), "may not set --alias"),
        (shape("sglang", tensor_split=(1.0,)), "llama.cpp option"),
        (tp("llamacpp", tensor_split=(1.0,)), "one proportion per card"),
        (tp("llamacpp", tensor_split=(0.0, 0.0)), "at least one above 0"),
        (shape("llamacpp", served_model_name="a,b"), "may not contain ','"),
        (shape("trtllm", embeddings=True), "no embeddings"),
        (shape("mindie", served_model_name="-bad"), "MindIE model name"),
        (shape("mindie", extra_args=("--x",)), "no extra_args"),
        (shape("vllm", parallelism="ring"), "unknown parallelism"),
    ],
)
def test_refused_combinations(s: LaunchShape, why: str) -> None:
    with pytest.raises(CommandError, match=re.escape(why)):
        build_command(s)
