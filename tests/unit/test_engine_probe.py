"""Engine probe (C9): exact image refs, GPU gates, schedule; KV-offload red lines (C12)."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import pytest

from heteroflow.agent.engine_probe import (
    VERSION_LABEL,
    DockerImageStore,
    ProbeSchedule,
    default_templates,
    engine_version,
    kv_offload_check,
    normalize_ref,
    pip_installed,
    probe_engines,
)
from heteroflow.agent.inventory import GpuCard
from heteroflow.core.engines import ENGINES


class FakeStore:
    def __init__(self, refs: Iterable[str], labels: dict[str, str] | None = None,
                 version: str | None = None) -> None:
        self.refs = set(refs)
        self.labels = labels or {}
        self.version = version
        self.version_calls: list[tuple[str, str]] = []

    def local_tags(self) -> set[str]:
        return set(self.refs)

    def image_labels(self, ref: str) -> dict[str, str]:
        return dict(self.labels)

    def distribution_version(self, ref: str, dist: str) -> str | None:
        self.version_calls.append((ref, dist))
        return self.version


def card(vendor: str = "nvidia", cc: str | None = "8.6", model: str = "A10") -> GpuCard:
    return GpuCard(index=0, uuid=f"GPU-{model}", vendor=vendor, model=model,
                   memory_total_mb=16384, memory_used_mb=0, compute_capability=cc,
                   mig_capable=False, mps_capable=False, temperature_c=None, source="declared")


T4 = card(cc="7.5", model="T4")
P100 = card(cc="6.0", model="P100")
A100 = card(cc="8.0", model="A100")
ASCEND = card(vendor="ascend", cc=None, model="910B")
MUSA = card(vendor="musa", cc=None, model="S4000")
AMD = card(vendor="amd", cc=None, model="MI300X")

VLLM = "vllm/vllm-openai:v0.11.2"
TEMPLATES = {"vllm": VLLM, "sglang": "lmsysorg/sglang:v0.5.5", "llamacpp": "llama:server",
             "mindie": "mindie:2.2", "vllm-mtt": "mthreads/vllm:v1", "trtllm": "trt:1"}
ALL_IMAGES = set(TEMPLATES.values())


def no_pip(dist: str) -> bool:
    return False


def probe(refs: Iterable[str], gpus: list[GpuCard], templates: dict[str, str] | None = None,
          pip: Any = no_pip) -> dict[str, str]:
    return probe_engines(FakeStore(refs), templates or TEMPLATES, gpus, pip).available


# --- image matching -----------------------------------------------------------------


@pytest.mark.feature("C9")
def test_exact_tag_is_available_other_tag_is_not() -> None:
    assert probe([VLLM], [A100]) == {"vllm": VLLM}
    assert probe(["vllm/vllm-openai:v0.11.1", "vllm/vllm-openai:latest"], [A100]) == {}


@pytest.mark.feature("C9")
def test_bare_name_means_latest() -> None:
    templates = {"vllm": "vllm/vllm-openai"}
    assert probe(["vllm/vllm-openai:latest"], [A100], templates) == {"vllm": "vllm/vllm-openai"}
    assert probe(["vllm/vllm-openai:v1"], [A100], templates) == {}
    latest = {"vllm": "vllm/vllm-openai:latest"}
    assert probe(["docker.io/vllm/vllm-openai"], [A100], latest) == latest
    assert normalize_ref("docker.io/library/ubuntu") == "ubuntu:latest"
    assert normalize_ref("localhost:5000/x") == "localhost:5000/x:latest"


@pytest.mark.feature("C9")
def test_digests_compared_exactly() -> None:
    pinned = {"vllm": "vllm/vllm-openai:v0.11.2@sha256:aaa"}
    assert probe(["vllm/vllm-openai@sha256:aaa"], [A100], pinned) == pinned
    assert probe(["vllm/vllm-openai@sha256:bbb", VLLM], [A100], pinned) == {}


@pytest.mark.feature("C9")
def test_other_registry_copy_unavailable_with_docker_tag_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    copy = "registry.example.com/vllm/vllm-openai:v0.11.2"
    with caplog.at_level(logging.WARNING):
        result = probe_engines(FakeStore([copy]), TEMPLATES, [A100], no_pip)
    assert result.available == {}
    assert len(result.warnings) == 1
    assert f"docker tag {copy} {VLLM}" in result.warnings[0]
    assert "docker tag" in caplog.text
    # and the other way round: the template names the private registry
    mirrored = {"vllm": copy}
    result = probe_engines(FakeStore([VLLM]), mirrored, [A100], no_pip)
    assert result.available == {} and f"docker tag {VLLM} {copy}" in result.warnings[0]


@pytest.mark.feature("C9")
def test_pip_engines_and_image_wins() -> None:
    installed = {"vllm", "xllamacpp"}
    assert probe([], [A100], pip=installed.__contains__) == {"vllm": "", "llamacpp": ""}
    assert probe([VLLM], [A100], pip=installed.__contains__) == {"vllm": VLLM, "llamacpp": ""}
    # no image store at all (process runtime): pip only
    result = probe_engines(None, TEMPLATES, [], installed.__contains__)
    assert result.available == {"llamacpp": ""}
    assert pip_installed("pytest") and not pip_installed("no-such-dist-heteroflow")


# --- GPU gates --------------------------------------------------------------------


@pytest.mark.feature("C9")
def test_t4_gets_vllm_not_sglang() -> None:
    assert probe(ALL_IMAGES, [T4]) == {"vllm": VLLM, "llamacpp": "llama:server"}


@pytest.mark.feature("C9")
def test_p100_gets_neither() -> None:
    assert probe(ALL_IMAGES, [P100]) == {"llamacpp": "llama:server"}
    assert probe(ALL_IMAGES, [card(cc=None)]) == {"llamacpp": "llama:server"}


@pytest.mark.feature("C9")
def test_best_card_counts_and_newer_cards_get_sglang() -> None:
    assert probe(ALL_IMAGES, [P100, A100]) == {
        "vllm": VLLM, "sglang": "lmsysorg/sglang:v0.5.5", "llamacpp": "llama:server",
    }


@pytest.mark.feature("C9")
def test_no_gpu_llamacpp_only() -> None:
    assert probe(ALL_IMAGES, []) == {"llamacpp": "llama:server"}


@pytest.mark.feature("C9")
def test_vendor_engines() -> None:
    assert probe(ALL_IMAGES, [ASCEND]) == {"mindie": "mindie:2.2", "llamacpp": "llama:server"}
    assert probe(ALL_IMAGES, [MUSA]) == {"vllm-mtt": "mthreads/vllm:v1",
                                         "llamacpp": "llama:server"}
    assert probe(ALL_IMAGES, [AMD]) == {"vllm": VLLM, "sglang": "lmsysorg/sglang:v0.5.5",
                                        "llamacpp": "llama:server"}


@pytest.mark.feature("C9")
def test_trtllm_never_reported() -> None:
    assert "trtllm" not in probe(ALL_IMAGES, [A100])
    assert "trtllm" not in default_templates()
    assert default_templates()["vllm"] == ENGINES["vllm"].default_image
    merged = default_templates({"vllm": VLLM, "trtllm": "trt:1"})
    assert merged["vllm"] == VLLM and "trtllm" not in merged
    assert merged["sglang"] == ENGINES["sglang"].default_image


# --- schedule, version ------------------------------------------------------------


@pytest.mark.feature("C9")
def test_probe_schedule() -> None:
    schedule = ProbeSchedule()
    assert [n for n in range(61) if schedule.due(n)] == [0, 20, 40, 60]
    assert ProbeSchedule(every=1).due(7)
    with pytest.raises(ValueError):
        ProbeSchedule(every=0)


@pytest.mark.feature("C12")
def test_engine_version_label_then_container() -> None:
    labelled = FakeStore([VLLM], labels={VERSION_LABEL: "0.11.2"}, version="9.9")
    assert engine_version(labelled, VLLM) == "0.11.2" and labelled.version_calls == []
    probed = FakeStore([VLLM], version="0.10.1")
    assert engine_version(probed, VLLM) == "0.10.1"
    assert probed.version_calls == [(VLLM, "vllm")]


@pytest.mark.feature("C12")
def test_docker_store_against_a_fake_client() -> None:
    class Image:
        tags = [VLLM]
        attrs = {"RepoDigests": ["vllm/vllm-openai@sha256:aaa"]}
        labels = {"a": "b"}

    class Images:
        def list(self) -> list[Image]:
            return [Image()]

        def get(self, ref: str) -> Image:
            if ref != VLLM:
                raise LookupError(ref)
            return Image()

    class Containers:
        def __init__(self) -> None:
            self.calls: list[tuple[str, Any, dict[str, Any]]] = []

        def run(self, ref: str, command: Any, **kwargs: Any) -> bytes:
            self.calls.append((ref, command, kwargs))
            return b"0.11.2\n"

    class Client:
        images = Images()
        containers = Containers()

    store = DockerImageStore(Client())
    assert store.local_tags() == {VLLM, "vllm/vllm-openai@sha256:aaa"}
    assert store.image_labels(VLLM) == {"a": "b"} and store.image_labels("nope:1") == {}
    assert store.distribution_version(VLLM, "vllm") == "0.11.2"
    ref, command, kwargs = Client.containers.calls[0]
    assert ref == VLLM and command[-1] == "vllm" and kwargs["remove"] is True
    with pytest.raises(ValueError):
        store.distribution_version(VLLM, "vllm; rm -rf /")


# --- KV offload red lines -----------------------------------------------------------

GIB = 1024  # MiB


@pytest.mark.feature("C12")
def test_kv_offload_off_and_within_lines() -> None:
    assert kv_offload_check(0, 500, 1, 1) is None
    # 100 GiB total: 70 GiB line; 30 declared + 40 = 70 -> exactly on the line is allowed
    assert kv_offload_check(40, 30, 100 * GIB, 100 * GIB) is None


@pytest.mark.feature("C12")
def test_kv_offload_node_total_over_70_percent_of_memtotal() -> None:
    reason = kv_offload_check(41, 30, 100 * GIB, 100 * GIB)
    assert reason is not None
    assert "MemTotal" in reason and "71 GiB" in reason and "70.0 GiB" in reason


@pytest.mark.feature("C12")
def test_kv_offload_instance_over_70_percent_of_memavailable() -> None:
    assert kv_offload_check(14, 0, 100 * GIB, 20 * GIB) is None  # 14 <= 14
    reason = kv_offload_check(15, 0, 100 * GIB, 20 * GIB)
    assert reason is not None
    assert "MemAvailable" in reason and "15 GiB" in reason and "14.0 GiB" in reason


@pytest.mark.feature("C12")
def test_kv_offload_negative_refused() -> None:
    assert kv_offload_check(-1, 0, 100 * GIB, 100 * GIB) is not None
