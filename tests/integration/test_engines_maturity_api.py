"""GET /api/v1/engines (H8): every engine, each capability with its maturity label."""

from __future__ import annotations

import pytest

from heteroflow.core.engines.registry import ENGINES

from .conftest import Api


@pytest.mark.feature("H8")
def test_engines_lists_each_capability_with_its_label(api: Api) -> None:
    r = api.client.get("/api/v1/engines", headers=api.login())
    assert r.status_code == 200, r.text
    engines = {e["name"]: e for e in r.json()}
    assert list(engines) == list(ENGINES)
    llama = {c["name"]: c for c in engines["llamacpp"]["capabilities"]}
    assert llama["chat"]["label"] == "verified-ci-cpu"
    assert llama["chat"]["evidence"].startswith("tests/")
    assert llama["gpu:nvidia"]["label"] == "built-unverified"
    assert llama["gpu:nvidia"]["evidence"] == ""
    vllm = {c["name"]: c for c in engines["vllm"]["capabilities"]}
    assert {"chat", "tools", "metrics", "sleep_mode", "shape:pipeline"} <= set(vllm)
    assert vllm["chat"]["label"] == "verified-ci-cpu"  # its CPU build, in CI
    assert vllm["chat"]["evidence"] == "tests/e2e/test_vllm_real.py"
    assert vllm["sleep_mode"]["label"] == vllm["shape:pipeline"]["label"] == "built-unverified"
    assert engines["trtllm"]["explicit_only"] is True
    labels = {c["label"] for e in engines.values() for c in e["capabilities"]}
    assert "verified-gpu" not in labels  # no engine has run on a card in this project


def test_engines_needs_a_signed_in_caller(api: Api) -> None:
    assert api.client.get("/api/v1/engines").status_code == 401
