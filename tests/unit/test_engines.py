"""Engine resolution: explicit engine, then label, then a keyword in the image name."""

from __future__ import annotations

import pytest

from heteroflow.core.engines import CPU_CAPABLE, ENGINES, engine_from_image, resolve_engine

pytestmark = pytest.mark.feature("H1")

DIGEST = "sha256:" + "0123456789abcdef" * 4


@pytest.mark.parametrize(
    ("image", "engine"),
    [
        ("vllm/vllm-openai", "vllm"),
        ("vllm/vllm-openai:v0.6.3", "vllm"),
        ("lmsysorg/sglang", "sglang"),
        ("lmsysorg/sglang:v0.4.0-cu124", "sglang"),
        ("ghcr.io/ggml-org/llama.cpp:server", "llamacpp"),
        ("example.com/llamacpp", "llamacpp"),
        ("example.com/llama-cpp-python:latest", "llamacpp"),
        ("nvcr.io/nvidia/tritonserver:24.05-trtllm-python-py3", "trtllm"),
        ("example.com/tensorrt-llm/release:0.12", "trtllm"),
        ("mthreads/vllm-mtt", "vllm-mtt"),
        ("registry.example/mthreads/vllm-mtt:0.4", "vllm-mtt"),
        ("ascendhub/mindie:1.0.0", "mindie"),
        ("VLLM/VLLM-OPENAI", "vllm"),
        (f"lmsysorg/sglang@{DIGEST}", "sglang"),
        (f"mthreads/vllm-mtt@{DIGEST}", "vllm-mtt"),
    ],
)
def test_engine_from_image(image: str, engine: str) -> None:
    assert engine_from_image(image) == engine
    assert engine in ENGINES


def test_vllm_mtt_is_not_plain_vllm() -> None:
    assert engine_from_image("mthreads/vllm-mtt:latest") != "vllm"


@pytest.mark.parametrize(
    "image",
    [
        "",
        "python:3.11-slim",
        "ubuntu@sha256:" + "ab" * 32,
        "example.com/plain-server:1.0",
    ],
)
def test_unknown_image_names_no_engine(image: str) -> None:
    assert engine_from_image(image) == ""


def test_digest_part_is_not_searched() -> None:
    # Only the name before '@' counts; anything after it is ignored, even if it spells an engine.
    assert engine_from_image("example.com/plain@sha256:vllm") == ""
    assert engine_from_image("example.com/plain@mindie") == ""


def test_explicit_engine_wins_over_label_and_image() -> None:
    engine, why = resolve_engine("sglang", "mindie", "vllm/vllm-openai")
    assert engine == "sglang"
    assert "explicit" in why


def test_label_wins_over_image() -> None:
    engine, why = resolve_engine("", "mindie", "vllm/vllm-openai")
    assert engine == "mindie"
    assert "label" in why


def test_image_decides_when_nothing_explicit() -> None:
    engine, why = resolve_engine("", "", "lmsysorg/sglang:latest")
    assert engine == "sglang"
    assert "lmsysorg/sglang:latest" in why
    assert "sglang" in why


def test_unknown_image_left_to_the_node_chain() -> None:
    engine, why = resolve_engine("", "", "python:3.11")
    assert engine == ""
    assert "node" in why
    assert "chain" in why


def test_reasons_are_distinct_per_source() -> None:
    whys = {
        resolve_engine("vllm", "", "")[1],
        resolve_engine("", "vllm", "")[1],
        resolve_engine("", "", "vllm/vllm-openai")[1],
        resolve_engine("", "", "")[1],
    }
    assert len(whys) == 4


def test_only_llamacpp_runs_on_cpu() -> None:
    assert set(CPU_CAPABLE) == {"llamacpp"}
