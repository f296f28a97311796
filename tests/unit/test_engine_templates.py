"""One-click templates: node reports + compute capability, never an invented image (H2)."""

from __future__ import annotations

import pytest

from heteroflow.core.engines import NodeEngines, Template, inference_templates

pytestmark = pytest.mark.feature("H2")

# Deliberately not the upstream names: a template must carry what the node reported.
REPORTED = {
    "vllm": "registry.local/mirror/vllm-openai:v0.11.2",
    "sglang": "lmsysorg/sglang@sha256:" + "ab" * 32,
    "llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda-b6000",
}


def node(
    vendor: str, *ccs: str, engines: tuple[str, ...] = ("vllm", "sglang", "llamacpp")
) -> NodeEngines:
    return NodeEngines(vendor, ccs, {e: REPORTED[e] for e in engines})


def engines_of(templates: list[Template]) -> list[str]:
    return [t.engine for t in templates]


def test_a10_gets_vllm_then_sglang_then_llamacpp() -> None:
    templates = inference_templates(node("nvidia", "8.6"))
    assert engines_of(templates) == ["vllm", "sglang", "llamacpp"]
    assert [t.image for t in templates] == [REPORTED[e] for e in ("vllm", "sglang", "llamacpp")]
    assert all(t.reason for t in templates)


def test_t4_excludes_sglang() -> None:
    assert engines_of(inference_templates(node("nvidia", "7.5"))) == ["vllm", "llamacpp"]


def test_p100_falls_to_llamacpp() -> None:
    assert engines_of(inference_templates(node("nvidia", "6.0"))) == ["llamacpp"]


def test_v100_meets_the_template_rule_of_cc_7_0() -> None:
    assert engines_of(inference_templates(node("nvidia", "7.0"))) == ["vllm", "llamacpp"]


def test_one_card_meeting_the_gate_is_enough() -> None:
    assert engines_of(inference_templates(node("nvidia", "6.0", "8.0"))) == [
        "vllm",
        "sglang",
        "llamacpp",
    ]


def test_nothing_available_gives_an_empty_list() -> None:
    assert inference_templates(node("nvidia", "8.6", engines=())) == []


def test_only_reported_engines_appear() -> None:
    assert engines_of(inference_templates(node("nvidia", "8.6", engines=("sglang",)))) == ["sglang"]


def test_non_nvidia_nodes_only_get_llamacpp() -> None:
    assert engines_of(inference_templates(node("amd"))) == ["llamacpp"]
    assert inference_templates(node("ascend", engines=("vllm",))) == []


def test_nvidia_without_reported_cc_gets_no_gpu_engine() -> None:
    assert engines_of(inference_templates(node("nvidia"))) == ["llamacpp"]


def test_cpu_node_gets_the_process_engine_with_its_reported_empty_image() -> None:
    [template] = inference_templates(NodeEngines("", (), {"llamacpp": ""}))
    assert (template.engine, template.image) == ("llamacpp", "")
