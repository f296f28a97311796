"""Tool calling on vLLM and SGLang (issue 15 item 3): the parser per model family as data,
on the command line unless the task chooses its own; every flag one the engine accepts."""

from __future__ import annotations

import pytest

from heteroflow.core.engines import LaunchShape, build_command
from heteroflow.core.engines.flags import accepted_flags
from heteroflow.core.engines.tool_parsers import TOOL_PARSERS, command_args, family_of

pytestmark = pytest.mark.feature("M13")


@pytest.mark.parametrize(
    ("path", "vllm", "sglang"),
    [
        ("/data/models/Qwen/Qwen2.5-7B-Instruct", "hermes", "qwen25"),
        ("Qwen/Qwen3-8B", "hermes", "qwen25"),
        ("/m/Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_coder", "qwen3_coder"),
        ("/m/NousResearch/Hermes-3-Llama-3.1-8B", "hermes", None),
        ("/m/meta-llama/Llama-3.1-8B-Instruct", "llama3_json", "llama3"),
        ("/m/meta-llama/Meta-Llama-3-8B-Instruct", "llama3_json", "llama3"),
        ("/m/meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4_pythonic", "pythonic"),
        ("/m/mistralai/Mistral-7B-Instruct-v0.3", "mistral", "mistral"),
        ("/m/deepseek-ai/DeepSeek-V3-0324", "deepseek_v3", "deepseekv3"),
        ("/m/deepseek-ai/DeepSeek-V3.1", "deepseek_v31", "deepseekv31"),
        ("/m/ibm-granite/granite-3.1-8b-instruct", "granite", None),
        ("/m/internlm/internlm2_5-7b-chat", "internlm", None),
        ("/m/ai21labs/AI21-Jamba-1.5-Mini", "jamba", None),
        ("/m/moonshotai/Kimi-K2-Instruct", "kimi_k2", "kimi_k2"),
        ("/m/zai-org/GLM-4.5-Air", "glm45", "glm45"),
        ("/m/openai/gpt-oss-20b", "openai", "gpt-oss"),
    ],
)
def test_family_table(path: str, vllm: str | None, sglang: str | None) -> None:
    family = family_of(path)
    assert family is not None
    assert (family.vllm, family.sglang) == (vllm, sglang)
    v = command_args("vllm", path, ())
    assert v == (("--enable-auto-tool-choice", "--tool-call-parser", vllm) if vllm else ())
    assert command_args("sglang", path, ()) == (("--tool-call-parser", sglang) if sglang else ())
    assert command_args("llamacpp", path, ()) == ()


def test_unknown_family_and_the_tasks_own_choice() -> None:
    assert family_of("/data/models/my-finetune") is None
    assert command_args("vllm", "/data/models/my-finetune", ()) == ()
    qwen = "/m/Qwen/Qwen2.5-7B-Instruct"
    for own in (("--tool-call-parser", "pythonic"), ("--tool_call_parser=x",),
                ("--enable-auto-tool-choice",)):  # fmt: skip
        assert command_args("vllm", qwen, own) == ()
    for pooling in (("--task", "embed"), ("--runner=pooling",), ("--is-embedding",)):
        assert command_args("vllm", qwen, pooling) == ()
    assert command_args("sglang", qwen, (), embeddings=True) == ()
    # the path's last two parts only: a directory named after a family does not count
    assert family_of("/srv/qwen-cache/models/acme/chat-7b") is None


def test_the_task_override_reaches_the_command_line() -> None:
    own = ("--enable-auto-tool-choice", "--tool-call-parser", "xlam")
    shape = LaunchShape("vllm", "/m/Qwen/Qwen2.5-7B", "q", 8000, extra_args=own)
    args = build_command(shape).args
    assert args.count("--tool-call-parser") == 1
    assert args[-3:] == ("--enable-auto-tool-choice", "--tool-call-parser", "xlam")


@pytest.mark.parametrize("engine", ["vllm", "vllm-mtt", "sglang"])
def test_every_family_flag_is_one_the_engine_accepts(engine: str) -> None:
    accepted = accepted_flags(engine)
    for family in TOOL_PARSERS:
        shape = LaunchShape(engine, f"/m/org/{family.family}-model", "m", 8000)
        flags = [a for a in build_command(shape).args if a.startswith("-")]
        assert set(flags) <= accepted, family.family


def test_headless_pipeline_stages_get_no_tool_flags() -> None:
    stage = LaunchShape(
        "vllm", "/m/Qwen/Qwen2.5-7B", "q", 8000, parallelism="pipeline", gpus=1,
        pipeline_parallel_size=2, pipeline_rank=1, master_addr="10.0.0.1",
    )  # fmt: skip
    assert "--tool-call-parser" not in build_command(stage).args


def test_llamacpp_always_gets_jinja() -> None:
    assert "--jinja" in build_command(LaunchShape("llamacpp", "/m/x.gguf", "x", 8000)).args
