"""The maturity labels (H8): one table, honest claims, and the docs generated from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.core.engines.maturity import (
    BUILT_UNVERIFIED,
    LABELS,
    MATRIX_BEGIN,
    MATRIX_END,
    VERIFIED_CI_CPU,
    VERIFIED_GPU,
    capability_names,
    catalog,
    markdown_matrix,
    proofs,
)
from heteroflow.core.engines.registry import ENGINES

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.feature("H8")


def test_every_engine_of_the_registry_is_listed_with_labelled_capabilities() -> None:
    listed = catalog()
    assert [e.name for e in listed] == list(ENGINES)
    for e in listed:
        assert e.capabilities, e.name
        assert all(c.label in LABELS for c in e.capabilities)
        names = [c.name for c in e.capabilities]
        assert len(names) == len(set(names)), e.name


def test_capabilities_follow_the_registry_record() -> None:
    for name, spec in ENGINES.items():
        caps = set(capability_names(spec))
        assert {f"shape:{s}" for s in spec.shapes} <= caps
        assert ("shape:pipeline" in caps) == ("pipeline" in spec.shapes)
        assert ("sleep_mode" in caps) == spec.supports_sleep, name
        assert ("metrics" in caps) == bool(spec.metrics), name
        assert {f"gpu:{v}" for v in spec.vendors if v != "cpu"} <= caps
    assert "cpu" in capability_names(ENGINES["llamacpp"])
    assert "cpu" not in capability_names(ENGINES["sglang"])


def test_a_verified_label_names_the_test_that_runs_the_real_engine() -> None:
    for (engine, cap), proof in proofs().items():
        if proof.label == BUILT_UNVERIFIED:
            assert not proof.evidence, (engine, cap)
            continue
        assert proof.evidence.startswith("tests/"), (engine, cap)
        assert (ROOT / proof.evidence).is_file(), f"{engine} {cap}: {proof.evidence} is gone"


def test_every_recorded_proof_is_of_a_capability_the_engine_has() -> None:
    """A proof of something the registry no longer says the engine does is a stale claim."""
    for engine, cap in proofs():
        assert cap in capability_names(ENGINES[engine]), (engine, cap)


def test_what_is_proven_today() -> None:
    """llama.cpp runs in CI on the CPU, and so does vLLM's CPU build for what
    tests/e2e/test_vllm_real.py runs; nothing has run on a GPU."""
    by_name = {e.name: e for e in catalog()}
    llama = by_name["llamacpp"]
    for cap in ("chat", "tools", "embeddings", "metrics", "sleep", "cpu", "shape:single"):
        assert llama.label_of(cap) == VERIFIED_CI_CPU, cap
    assert llama.label_of("gpu:nvidia") == BUILT_UNVERIFIED
    assert llama.label_of("shape:tensor_parallel") == BUILT_UNVERIFIED
    assert not any(c.label == VERIFIED_GPU for e in by_name.values() for c in e.capabilities)
    vllm = by_name["vllm"]
    for cap in ("chat", "tools", "metrics", "cpu", "shape:single"):
        assert vllm.label_of(cap) == VERIFIED_CI_CPU, cap
    for cap in ("embeddings", "sleep_mode", "kv_offload", "gpu:nvidia", "shape:pipeline"):
        assert vllm.label_of(cap) == BUILT_UNVERIFIED, cap
    for name in ("sglang", "trtllm", "mindie", "vllm-mtt"):
        assert {c.label for c in by_name[name].capabilities} == {BUILT_UNVERIFIED}, name


def test_docs_engines_md_holds_the_generated_matrix() -> None:
    page = (ROOT / "docs" / "engines.md").read_text()
    assert page.count(MATRIX_BEGIN) == 1 and page.count(MATRIX_END) == 1
    shown = page[page.index(MATRIX_BEGIN) : page.index(MATRIX_END) + len(MATRIX_END)]
    assert shown == markdown_matrix(), (
        "docs/engines.md's maturity matrix differs from core/engines/maturity.py; paste "
        "the output of: python -c 'from heteroflow.core.engines.maturity import "
        "markdown_matrix; print(markdown_matrix())'"
    )
