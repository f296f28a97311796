"""A fake NVML module for tests: the ``pynvml`` functions ``agent.inventory`` uses.

``FakeNvml`` is configured with ``FakeCard`` entries and can be told to fail at
initialisation, or per card and per call, with the same kind of exceptions real ``pynvml``
raises (``NVMLError`` and its ``NVMLError_NotSupported`` subclass). It records whether
``nvmlShutdown`` was called. It is test support only: production code never imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MIB = 1024 * 1024

NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_UNKNOWN = 999
NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    """Fake of ``pynvml.NVMLError``: carries the NVML return code in ``value``."""

    def __init__(self, value: int, message: str = "") -> None:
        super().__init__(message or f"NVML error {value}")
        self.value = value


class NVMLError_NotSupported(NVMLError):  # pynvml's own spelling
    """Fake of ``pynvml.NVMLError_NotSupported``."""

    def __init__(self, message: str = "Not Supported") -> None:
        super().__init__(NVML_ERROR_NOT_SUPPORTED, message)


@dataclass(frozen=True)
class FakeUtilization:
    """Percent of the last sample period, like ``pynvml.c_nvmlUtilization_t``."""

    gpu: int
    memory: int


@dataclass(frozen=True)
class FakeMemoryInfo:
    """Bytes, like ``pynvml.c_nvmlMemory_t``."""

    total: int
    used: int
    free: int


@dataclass
class FakeCard:
    """One fake device. ``fail`` maps a pynvml function name to the exception it raises."""

    name: str = "NVIDIA A10"
    uuid: str = "GPU-00000000-0000-0000-0000-000000000000"
    memory_total_mb: int = 24576
    memory_used_mb: int = 0
    compute_capability: tuple[int, int] = (8, 6)
    mig_supported: bool = False
    mig_enabled: bool = False  # the current mode (a real H200 answers [0, 0]: disabled)
    temperature_c: int = 40
    # nvmlDeviceGetUtilizationRates(...).gpu; None: the counter is not supported (MIG)
    utilization_pct: int | None = None
    fail: dict[str, Exception] = field(default_factory=dict)


class FakeNvml:
    """Stands in for the ``pynvml`` module (pass it to ``NvmlDiscovery``)."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU
    NVML_P2P_CAPS_INDEX_NVLINK = 2
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5

    def __init__(self, cards: list[FakeCard] | None = None,
                 init_error: Exception | None = None,
                 nvlink: set[frozenset[int]] | None = None,
                 p2p_error: Exception | None = None) -> None:
        self.cards = list(cards or [])
        self.nvlink = nvlink or set()  # pairs of card indices joined by NVLink
        self.p2p_error = p2p_error
        self.init_error = init_error
        self.initialised = False
        self.shutdown_calls = 0

    @classmethod
    def from_recorded(cls, raw: dict[str, Any], *, mig_on: bool = False) -> FakeNvml:
        """Replay what NVML answered on a real machine (``scripts/device-check-nvml.py``'s
        ``raw``, e.g. ``tests/data/nvml/h200.json``)."""
        cards = [
            FakeCard(
                name=c["name"],
                uuid=c["uuid"],
                memory_total_mb=c["memory"]["total"] // MIB,
                memory_used_mb=c["memory"]["used"] // MIB,
                compute_capability=(c["compute_capability"][0], c["compute_capability"][1]),
                mig_supported=isinstance(c["mig_mode"], list),
                mig_enabled=mig_on or c["mig_mode"][0] == 1,
                temperature_c=c["temperature"],
                # an int, or NVML's error as recorded; absent in recordings before it was read
                utilization_pct=u if isinstance(u := c.get("utilization"), int) else None,
            )
            for c in raw["cards"]
        ]
        return cls(cards)

    def _card(self, handle: object, call: str) -> FakeCard:
        if not self.initialised:
            raise NVMLError(1, "Uninitialized")
        if not isinstance(handle, FakeCard):
            raise NVMLError(2, "Invalid Argument")
        if call in handle.fail:
            raise handle.fail[call]
        return handle

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.initialised = True

    def nvmlShutdown(self) -> None:
        if not self.initialised:
            raise NVMLError(1, "Uninitialized")
        self.initialised = False
        self.shutdown_calls += 1

    def nvmlDeviceGetCount(self) -> int:
        if not self.initialised:
            raise NVMLError(1, "Uninitialized")
        return len(self.cards)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeCard:
        if not self.initialised:
            raise NVMLError(1, "Uninitialized")
        card = self.cards[index]
        if "nvmlDeviceGetHandleByIndex" in card.fail:
            raise card.fail["nvmlDeviceGetHandleByIndex"]
        return card

    def nvmlDeviceGetName(self, handle: object) -> str:
        return self._card(handle, "nvmlDeviceGetName").name

    def nvmlDeviceGetUUID(self, handle: object) -> str:
        return self._card(handle, "nvmlDeviceGetUUID").uuid

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> FakeMemoryInfo:
        card = self._card(handle, "nvmlDeviceGetMemoryInfo")
        total, used = card.memory_total_mb * MIB, card.memory_used_mb * MIB
        return FakeMemoryInfo(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: object) -> tuple[int, int]:
        return self._card(handle, "nvmlDeviceGetCudaComputeCapability").compute_capability

    def nvmlDeviceGetMigMode(self, handle: object) -> list[int]:
        card = self._card(handle, "nvmlDeviceGetMigMode")
        if not card.mig_supported:
            raise NVMLError_NotSupported()
        mode = 1 if card.mig_enabled else 0
        return [mode, mode]

    def nvmlDeviceGetTemperature(self, handle: object, sensor: int) -> int:
        card = self._card(handle, "nvmlDeviceGetTemperature")
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError(2, "Invalid Argument")
        return card.temperature_c

    def nvmlDeviceGetUtilizationRates(self, handle: object) -> FakeUtilization:
        card = self._card(handle, "nvmlDeviceGetUtilizationRates")
        if card.utilization_pct is None:
            raise NVMLError_NotSupported()
        return FakeUtilization(gpu=card.utilization_pct, memory=0)

    def nvmlDeviceGetP2PStatus(self, device1: object, device2: object, p2p_index: int) -> int:
        a = self.cards.index(self._card(device1, "nvmlDeviceGetP2PStatus"))
        b = self.cards.index(self._card(device2, "nvmlDeviceGetP2PStatus"))
        if self.p2p_error is not None:
            raise self.p2p_error
        if p2p_index == self.NVML_P2P_CAPS_INDEX_NVLINK and frozenset({a, b}) in self.nvlink:
            return self.NVML_P2P_STATUS_OK
        return self.NVML_P2P_STATUS_NOT_SUPPORTED
