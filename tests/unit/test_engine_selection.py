"""Engine selection chain: explicit > label > image keyword > vendor chain (H1); TRT gates (H3)."""

from __future__ import annotations

import pytest

from heteroflow.core.engines import (
    CPU_CAPABLE,
    ENGINES,
    VENDOR_CHAINS,
    EngineChoice,
    NodeEngines,
    NoEngineAvailable,
    engine_spec,
    inference_templates,
    resolve_engine,
    select_engine,
    vendor_chain,
)
from heteroflow.core.engines.maturity import BUILT_UNVERIFIED, catalog, maturity_of

IMAGES = {
    "vllm": "vllm/vllm-openai:v0.11.2",
    "sglang": "lmsysorg/sglang:v0.5.4",
    "llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda",
    "trtllm": "nvcr.io/nvidia/tensorrt-llm/release:1.0.0",
    "mindie": "ascendhub/mindie:2.2.RC1",
    "vllm-mtt": "registry.mthreads.com/mcconline/inference/vllm/vllm-openai:v0.28.0",
}


def node(
    vendor: str,
    *ccs: str,
    engines: tuple[str, ...] = (),
    priorities: tuple[str, ...] | None = None,
) -> NodeEngines:
    available = {engine: IMAGES[engine] for engine in engines}
    return NodeEngines(vendor, ccs, available, priorities)


A10 = ("8.6",)
ALL_NVIDIA = ("vllm", "sglang", "llamacpp")


def chain_pick(n: NodeEngines) -> EngineChoice:
    return select_engine(explicit="", label="", image="python:3.11", node=n)


@pytest.mark.feature("H1")
def test_explicit_wins_over_label_image_and_availability() -> None:
    choice = select_engine(
        explicit="sglang", label="mindie", image="vllm/vllm-openai", node=node("nvidia", *A10)
    )
    assert choice == EngineChoice("sglang", "explicit task.engine", True)


@pytest.mark.feature("H1")
def test_label_wins_over_image() -> None:
    choice = select_engine(explicit="", label="mindie", image="vllm/vllm-openai", node=None)
    assert (choice.engine, choice.explicit) == ("mindie", True)
    assert "label" in choice.reason


@pytest.mark.feature("H1")
@pytest.mark.parametrize(
    ("image", "engine"),
    [
        ("vllm/vllm-openai:latest", "vllm"),
        ("lmsysorg/sglang:latest", "sglang"),
        ("ghcr.io/ggml-org/llama.cpp:server", "llamacpp"),
        ("example.com/llamacpp:1", "llamacpp"),
        ("nvcr.io/nvidia/tritonserver:24.05-trtllm-python-py3", "trtllm"),
        ("example.com/tensorrt-llm/release:1.0", "trtllm"),
        ("ascendhub/mindie:2.2.RC1", "mindie"),
        ("mthreads/vllm-mtt:0.4", "vllm-mtt"),
        ("registry.mthreads.com/mcconline/inference/vllm/vllm-openai:v0.28.0", "vllm-mtt"),
        ("example.com/vllm-musa:ubuntu22.04_py3.10", "vllm-mtt"),
    ],
)
def test_image_keyword_counts_as_explicit_and_skips_availability(image: str, engine: str) -> None:
    empty_node = node("nvidia", *A10)  # reports nothing available
    choice = select_engine(explicit="", label="", image=image, node=empty_node)
    assert (choice.engine, choice.explicit) == (engine, True)
    assert image in choice.reason


@pytest.mark.feature("H1")
def test_without_a_node_the_choice_is_left_to_the_chain() -> None:
    choice = select_engine(explicit="", label="", image="python:3.11", node=None)
    assert choice.engine == "" and not choice.explicit
    assert "chain" in choice.reason
    assert resolve_engine("", "", "python:3.11") == (choice.engine, choice.reason)


@pytest.mark.feature("H1")
def test_vendor_chains_are_the_spec_chains() -> None:
    assert VENDOR_CHAINS["nvidia"] == ("vllm", "sglang", "llamacpp")
    assert VENDOR_CHAINS["amd"] == VENDOR_CHAINS["hygon"] == ("vllm", "llamacpp")
    assert VENDOR_CHAINS["musa"] == ("vllm-mtt",)
    assert VENDOR_CHAINS["ascend"] == ("mindie",)
    assert VENDOR_CHAINS[""] == ("llamacpp",)
    assert vendor_chain("unknown-vendor") == ()


@pytest.mark.feature("H1")
@pytest.mark.parametrize(
    ("n", "engine"),
    [
        (node("nvidia", *A10, engines=ALL_NVIDIA), "vllm"),
        (node("nvidia", *A10, engines=("sglang", "llamacpp")), "sglang"),
        (node("nvidia", *A10, engines=("llamacpp",)), "llamacpp"),
        (node("amd", engines=("vllm", "llamacpp")), "vllm"),
        (node("amd", engines=("sglang", "llamacpp")), "llamacpp"),
        (node("hygon", engines=("llamacpp",)), "llamacpp"),
        (node("musa", engines=("vllm-mtt", "llamacpp")), "vllm-mtt"),
        (node("ascend", engines=("mindie",)), "mindie"),
        (node("", engines=("llamacpp", "vllm")), "llamacpp"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.vendor or "cpu",
)
def test_vendor_chain_takes_the_first_available_engine(n: NodeEngines, engine: str) -> None:
    choice = chain_pick(n)
    assert (choice.engine, choice.explicit) == (engine, False)
    assert "chain" in choice.reason


@pytest.mark.feature("H1")
@pytest.mark.parametrize(
    ("ccs", "engines", "engine"),
    [
        (("7.5",), ALL_NVIDIA, "vllm"),  # T4: vLLM's probe gate is >= 7.5 (C9)
        (("7.5",), ("sglang", "llamacpp"), "llamacpp"),  # SGLang needs newer than sm_75
        (("8.0",), ("sglang", "llamacpp"), "sglang"),
        (("6.0",), ALL_NVIDIA, "llamacpp"),  # P100
        (("6.0", "8.6"), ("vllm",), "vllm"),  # one card meeting the gate is enough
        ((), ALL_NVIDIA, "llamacpp"),  # no compute capability reported: no guessing
        (("sm_86",), ALL_NVIDIA, "llamacpp"),  # unreadable value counts as unknown
    ],
)
def test_compute_capability_gates_on_nvidia(
    ccs: tuple[str, ...], engines: tuple[str, ...], engine: str
) -> None:
    assert chain_pick(node("nvidia", *ccs, engines=engines)).engine == engine


@pytest.mark.feature("H1")
def test_skipped_engines_are_named_in_the_reason() -> None:
    choice = chain_pick(node("nvidia", "6.0", engines=ALL_NVIDIA))
    assert "vllm: needs an NVIDIA card with compute capability >= 7.5" in choice.reason
    assert "sglang: needs an NVIDIA card with compute capability > 7.5" in choice.reason


@pytest.mark.feature("H1")
def test_agent_priorities_override_the_vendor_chain() -> None:
    n = node("nvidia", *A10, engines=ALL_NVIDIA, priorities=("llamacpp", "vllm"))
    choice = chain_pick(n)
    assert choice.engine == "llamacpp"
    assert "engine_priorities" in choice.reason
    amd = node("amd", engines=("sglang", "llamacpp"), priorities=("sglang",))
    assert chain_pick(amd).engine == "sglang"  # SGLang runs on AMD when an operator says so


@pytest.mark.feature("H1")
def test_override_still_needs_vendor_support() -> None:
    n = node("nvidia", *A10, engines=("vllm-mtt",), priorities=("vllm-mtt",))
    with pytest.raises(NoEngineAvailable, match="vllm-mtt: does not run on nvidia cards"):
        chain_pick(n)


@pytest.mark.feature("H1")
def test_override_drops_unknown_duplicate_and_explicit_only_names() -> None:
    override = ("trtllm", "bogus", "sglang", "vllm", "sglang")
    assert vendor_chain("nvidia", override) == ("sglang", "vllm")
    assert vendor_chain("nvidia", ()) == ()


@pytest.mark.feature("H1")
def test_no_engine_available_says_what_the_node_has_and_the_chain_wanted() -> None:
    n = node("nvidia", "7.0", engines=("vllm", "mindie"))
    with pytest.raises(NoEngineAvailable) as excinfo:
        chain_pick(n)
    message = str(excinfo.value)
    assert "nvidia" in message
    assert "vllm -> sglang -> llamacpp" in message
    assert "mindie, vllm" in message  # what the node reports
    assert "7.0" in message
    assert "sglang: not reported available" in message
    with pytest.raises(NoEngineAvailable, match="CPU-only"):
        chain_pick(node("", engines=()))


@pytest.mark.feature("H3")
def test_trt_gate_1_no_chain_contains_trtllm() -> None:
    for vendor in VENDOR_CHAINS:
        assert "trtllm" not in vendor_chain(vendor)
        assert "trtllm" not in vendor_chain(vendor, ("trtllm", "llamacpp"))


@pytest.mark.feature("H3")
def test_trt_gate_2_template_is_explicit_only() -> None:
    assert ENGINES["trtllm"].explicit_only
    assert [spec.name for spec in ENGINES.values() if spec.explicit_only] == ["trtllm"]
    n = node("nvidia", "9.0", engines=("trtllm",))
    assert inference_templates(n) == []
    both = node("nvidia", "9.0", engines=("trtllm", "llamacpp"))
    assert [t.engine for t in inference_templates(both)] == ["llamacpp"]


@pytest.mark.feature("H3")
def test_trt_gate_3_chain_never_chooses_trtllm_even_when_available() -> None:
    n = node("nvidia", "9.0", engines=("trtllm",))
    with pytest.raises(NoEngineAvailable):
        chain_pick(n)
    overridden = node("nvidia", "9.0", engines=("trtllm",), priorities=("trtllm",))
    with pytest.raises(NoEngineAvailable):
        chain_pick(overridden)
    # Only an explicit choice reaches it.
    assert select_engine(explicit="trtllm", label="", image="", node=n).engine == "trtllm"
    by_image = select_engine(explicit="", label="", image=IMAGES["trtllm"], node=n)
    assert (by_image.engine, by_image.explicit) == ("trtllm", True)


@pytest.mark.feature("H3")
def test_trtllm_is_nvidia_only_without_pipeline() -> None:
    spec = engine_spec("trtllm")
    assert spec.vendors == frozenset({"nvidia"})
    assert spec.shapes == frozenset({"single", "tensor_parallel", "split"})
    assert {c.label for c in maturity_of(spec).capabilities} == {BUILT_UNVERIFIED}  # H8


@pytest.mark.feature("H1")
def test_registry_facts() -> None:
    assert list(ENGINES) == ["vllm", "sglang", "llamacpp", "trtllm", "mindie", "vllm-mtt"]
    assert set(CPU_CAPABLE) == {"llamacpp"}
    assert "pipeline" not in engine_spec("mindie").shapes
    assert {n for n, s in ENGINES.items() if s.supports_sleep} == {"vllm", "vllm-mtt"}
    # H8 (core/engines/maturity.py): only llama.cpp and vLLM's CPU build have run for real
    assert {e.name for e in catalog() if e.label_of("chat") != BUILT_UNVERIFIED} == {
        "llamacpp",
        "vllm",
    }
    assert engine_spec("vllm").metrics["running"] == "vllm:num_requests_running"
    with pytest.raises(ValueError, match="'tgi'"):
        engine_spec("tgi")
