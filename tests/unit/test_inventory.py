"""GPU inventory: NVML discovery against a fake NVML, declared cards, node inventory."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest

from heteroflow.agent import inventory
from heteroflow.agent.inventory import (
    GpuCard,
    NvmlDiscovery,
    collect_inventory,
    declared_cards,
)
from heteroflow.testing.fake_nvml import (
    NVML_ERROR_DRIVER_NOT_LOADED,
    NVML_ERROR_UNKNOWN,
    FakeCard,
    FakeNvml,
    NVMLError,
)

pytestmark = pytest.mark.feature("C1")

A10 = FakeCard(name="NVIDIA A10", uuid="GPU-a10", memory_total_mb=23028, memory_used_mb=512,
               compute_capability=(8, 6), mig_supported=False, temperature_c=41)
A100 = FakeCard(name="NVIDIA A100-SXM4-80GB", uuid="GPU-a100", memory_total_mb=81920,
                memory_used_mb=1024, compute_capability=(8, 0), mig_supported=True,
                temperature_c=55)


def card(**overrides: Any) -> FakeCard:
    base: dict[str, Any] = {"name": "NVIDIA T4", "uuid": "GPU-t4", "memory_total_mb": 15360,
            "compute_capability": (7, 5), "temperature_c": 50}
    base.update(overrides)
    return FakeCard(**base)


@pytest.fixture(autouse=True)
def _reset_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory, "_warned_declared_ignored", False)


def test_two_cards_discovered_with_memory_cc_and_temperature() -> None:
    fake = FakeNvml([A10, A100])
    cards = NvmlDiscovery(fake, platform="linux").discover()
    assert cards is not None and len(cards) == 2
    a10, a100 = cards
    assert a10 == GpuCard(index=0, uuid="GPU-a10", vendor="nvidia", model="NVIDIA A10",
                          memory_total_mb=23028, memory_used_mb=512, compute_capability="8.6",
                          mig_capable=False, mps_capable=True, temperature_c=41, source="nvml",
                          mig_enabled=False)
    assert (a100.index, a100.memory_total_mb, a100.memory_used_mb) == (1, 81920, 1024)
    assert (a100.compute_capability, a100.temperature_c) == ("8.0", 55)
    assert fake.shutdown_calls == 1 and not fake.initialised


def test_utilisation_is_read_with_the_card_and_none_where_nvml_has_no_counter() -> None:
    busy = card(uuid="GPU-busy", utilization_pct=73)
    mig = card(uuid="GPU-mig")  # no counter (MIG, some vGPUs): NVML says NotSupported
    broken = card(uuid="GPU-x", utilization_pct=5,
                  fail={"nvmlDeviceGetUtilizationRates": NVMLError(NVML_ERROR_UNKNOWN)})
    cards = NvmlDiscovery(FakeNvml([busy, mig, broken]), platform="linux").discover()
    assert cards is not None
    assert [c.utilization_pct for c in cards] == [73, None, None]
    assert cards[0].to_dict()["utilization_pct"] == 73  # what the heartbeat carries


def test_mig_supported_vs_not_supported() -> None:
    cards = NvmlDiscovery(FakeNvml([A100, A10]), platform="linux").discover()
    assert cards is not None
    assert [c.mig_capable for c in cards] == [True, False]


def test_mig_other_nvml_error_means_not_capable() -> None:
    broken = card(mig_supported=True, fail={"nvmlDeviceGetMigMode": NVMLError(NVML_ERROR_UNKNOWN)})
    cards = NvmlDiscovery(FakeNvml([broken]), platform="linux").discover()
    assert cards is not None and cards[0].mig_capable is False


def test_mps_capability_needs_cc_35_and_linux() -> None:
    kepler_old = card(uuid="GPU-k10", compute_capability=(3, 0))
    kepler_new = card(uuid="GPU-k80", compute_capability=(3, 7))
    on_linux = NvmlDiscovery(FakeNvml([kepler_old, kepler_new]), platform="linux").discover()
    on_windows = NvmlDiscovery(FakeNvml([kepler_new]), platform="win32").discover()
    assert on_linux is not None and on_windows is not None
    assert [c.mps_capable for c in on_linux] == [False, True]
    assert on_windows[0].mps_capable is False


def test_temperature_error_gives_none() -> None:
    hot = card(fail={"nvmlDeviceGetTemperature": NVMLError(NVML_ERROR_UNKNOWN)})
    cards = NvmlDiscovery(FakeNvml([hot]), platform="linux").discover()
    assert cards is not None and cards[0].temperature_c is None


def test_compute_capability_error_gives_none_and_no_mps() -> None:
    odd = card(fail={"nvmlDeviceGetCudaComputeCapability": NVMLError(NVML_ERROR_UNKNOWN)})
    cards = NvmlDiscovery(FakeNvml([odd]), platform="linux").discover()
    assert cards is not None
    assert (cards[0].compute_capability, cards[0].mps_capable) == (None, False)


def test_card_error_skips_that_card_only(caplog: pytest.LogCaptureFixture) -> None:
    lost = card(uuid="GPU-lost", fail={"nvmlDeviceGetMemoryInfo": NVMLError(NVML_ERROR_UNKNOWN)})
    fake = FakeNvml([A10, lost, A100])
    with caplog.at_level(logging.WARNING, logger="heteroflow.agent.inventory"):
        cards = NvmlDiscovery(fake, platform="linux").discover()
    assert cards is not None
    assert [(c.index, c.uuid) for c in cards] == [(0, "GPU-a10"), (2, "GPU-a100")]
    assert "skipping GPU 1" in caplog.text
    assert fake.shutdown_calls == 1


def test_bytes_names_are_decoded() -> None:
    class BytesNvml(FakeNvml):
        def nvmlDeviceGetName(self, handle: object) -> Any:
            return super().nvmlDeviceGetName(handle).encode()

    cards = NvmlDiscovery(BytesNvml([A10]), platform="linux").discover()
    assert cards is not None and cards[0].model == "NVIDIA A10"


def test_init_failure_returns_none_and_declared_cards_are_used() -> None:
    fake = FakeNvml([A10], init_error=NVMLError(NVML_ERROR_DRIVER_NOT_LOADED, "Driver Not Loaded"))
    discovery = NvmlDiscovery(fake)
    assert discovery.discover() is None
    assert fake.shutdown_calls == 0
    declared = declared_cards([{"index": 0, "vendor": "nvidia", "model": "A10",
                                "memory_mb": 24576, "compute_capability": "8.6"}])
    inv = collect_inventory(declared, discovery)
    assert inv.gpus == tuple(declared)
    assert inv.gpus[0].source == "declared"


def test_real_pynvml_path_never_invents_cards() -> None:
    """The default (real pynvml) path: None without a driver, else real NVML cards."""
    cards = NvmlDiscovery().discover()
    assert cards is None or all(c.source == "nvml" and c.vendor == "nvidia" for c in cards)


def test_device_count_failure_returns_none_and_shuts_down() -> None:
    class CountFails(FakeNvml):
        def nvmlDeviceGetCount(self) -> int:
            raise NVMLError(NVML_ERROR_UNKNOWN)

    fake = CountFails([A10])
    assert NvmlDiscovery(fake).discover() is None
    assert fake.shutdown_calls == 1


def test_nvml_cards_win_over_declared_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    declared = declared_cards([{"vendor": "amd", "model": "MI210", "memory_mb": 65536}])
    discovery = NvmlDiscovery(FakeNvml([A10]), platform="linux")
    with caplog.at_level(logging.WARNING, logger="heteroflow.agent.inventory"):
        first = collect_inventory(declared, discovery)
        collect_inventory(declared, discovery)
    assert [c.source for c in first.gpus] == ["nvml"]
    assert caplog.text.count("ignoring the 1 declared GPU") == 1


def test_empty_nvml_falls_back_to_declared() -> None:
    declared = declared_cards([{"vendor": "ascend", "model": "910B", "memory_mb": 65536}])
    inv = collect_inventory(declared, NvmlDiscovery(FakeNvml([])))
    assert [c.model for c in inv.gpus] == ["910B"]


def test_collect_inventory_host_figures_and_json() -> None:
    inv = collect_inventory([], None)
    assert inv.gpus == ()
    assert inv.cpu_count >= 1
    assert 0 < inv.memory_available_mb <= inv.memory_total_mb
    assert 0.0 <= inv.memory_percent <= 100.0 and inv.cpu_percent >= 0.0
    wire = json.loads(json.dumps(collect_inventory(
        declared_cards([{"vendor": "nvidia", "model": "A10", "memory_mb": 24576}]), None
    ).to_dict()))
    assert wire["gpus"][0]["memory_total_mb"] == 24576
    assert wire["gpus"][0]["uuid"] == "declared-0"


def test_declared_defaults_and_normalisation() -> None:
    cards = declared_cards([
        {"vendor": "NVIDIA", "model": "A10", "memory_mb": 24576, "compute_capability": "8.6",
         "mps_capable": True},
        {"index": 5, "uuid": "npu-5", "vendor": "ascend", "model": "910B", "memory_mb": 65536},
    ])
    assert [(c.index, c.uuid, c.vendor) for c in cards] == [
        (0, "declared-0", "nvidia"), (5, "npu-5", "ascend")]
    assert cards[0].mps_capable and not cards[0].mig_capable
    assert all(c.memory_used_mb == 0 and c.temperature_c is None for c in cards)


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([{"vendor": "nvidia", "model": "A10"}], "entry 0, field 'memory_mb': is required"),
        ([{"vendor": "nvidia", "model": "A10", "memory_mb": -1}], "field 'memory_mb'"),
        ([{"vendor": "nvidia", "model": "A10", "memory_mb": "24G"}], "field 'memory_mb'"),
        ([{"vendor": "nvidia", "memory_mb": 1}], "entry 0, field 'model': is required"),
        ([{"model": "x", "memory_mb": 1}], "field 'vendor': is required"),
        ([{"vendor": "voodoo", "model": "x", "memory_mb": 1}], "field 'vendor': unknown vendor"),
        ([{"vendor": "cpu", "model": "x", "memory_mb": 1}], "field 'vendor': unknown vendor"),
        ([{"index": -1, "vendor": "amd", "model": "x", "memory_mb": 1}], "field 'index'"),
        ([{"index": 0, "vendor": "amd", "model": "x", "memory_mb": 1},
          {"index": 0, "vendor": "amd", "model": "y", "memory_mb": 1}],
         "entry 1, field 'index': duplicate index 0 (already used by entry 0)"),
        ([{"vendor": "nvidia", "model": "x", "memory_mb": 1, "compute_capability": 8.6}],
         "field 'compute_capability'"),
        ([{"vendor": "amd", "model": "x", "memory_mb": 1, "mig_capable": True}],
         "field 'mig_capable'"),
        ([{"vendor": "amd", "model": "x", "memory_mb": 1, "memory_gb": 1}],
         "field 'memory_gb': unknown field"),
        ([{"vendor": "amd", "model": "x", "memory_mb": 1}, "A10"], "entry 1: expected a mapping"),
    ],
)
def test_declared_errors_name_entry_and_field(entries: list[Any], expected: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        declared_cards(entries)
    assert expected in str(excinfo.value)


@pytest.mark.feature("B1")
def test_nvlink_pairs_become_peers_and_errors_mean_pcie() -> None:
    four = [card(uuid=f"GPU-{i}") for i in range(4)]
    fake = FakeNvml(four, nvlink={frozenset({0, 1}), frozenset({0, 2}), frozenset({2, 3})})
    cards = NvmlDiscovery(fake, platform="linux").discover()
    assert cards is not None
    assert [c.nvlink_peers for c in cards] == [(1, 2), (0,), (0, 3), (2,)]
    assert cards[0].to_dict()["nvlink_peers"] == (1, 2)
    broken = FakeNvml(four, nvlink={frozenset({0, 1})}, p2p_error=NVMLError(NVML_ERROR_UNKNOWN))
    cards = NvmlDiscovery(broken, platform="linux").discover()
    assert cards is not None and all(c.nvlink_peers == () for c in cards)


@pytest.mark.feature("B1")
def test_declared_nvlink_peers_are_checked() -> None:
    (c0, c1) = declared_cards([
        {"vendor": "nvidia", "model": "H100", "memory_mb": 81920, "nvlink_peers": [1]},
        {"vendor": "nvidia", "model": "H100", "memory_mb": 81920, "nvlink_peers": [0]},
    ])
    assert (c0.nvlink_peers, c1.nvlink_peers) == ((1,), (0,))
    for bad in ([0], ["1"], 3, [-1]):
        with pytest.raises(ValueError, match="field 'nvlink_peers'"):
            declared_cards([{"vendor": "nvidia", "model": "H100", "memory_mb": 1,
                             "nvlink_peers": bad}])


@pytest.mark.feature("H5")
def test_an_agent_inside_a_container_labels_its_node_containerized(tmp_path: Any) -> None:
    from heteroflow.agent.inventory import node_labels

    assert node_labels({"zone": "a"}, root=tmp_path) == {"zone": "a"}
    (tmp_path / ".dockerenv").write_text("")
    assert node_labels({"zone": "a"}, root=tmp_path) == {
        "zone": "a", "heteroflow.containerized": "true"}
    # the operator's configured value wins over the detection
    assert node_labels({"heteroflow.containerized": "false"}, root=tmp_path) == {
        "heteroflow.containerized": "false"}
