"""The node's hardware inventory: GPU cards, CPU and host memory, as reported in heartbeats.

This module owns where the agent's GPU list comes from and what it looks like on the wire:

* ``NvmlDiscovery`` asks the NVIDIA driver (through an injectable NVML module, ``pynvml``
  by default) and returns ``None`` when there is no NVML (library missing, no driver).
* ``declared_cards`` parses the cards the operator declares openly in the agent config, for
  hosts without NVML (non-NVIDIA accelerators, or NVIDIA cards NVML cannot see).
* ``collect_inventory`` picks between the two (NVML wins when it finds cards) and adds the
  host CPU and memory figures from psutil.

Nothing here invents a GPU: a card comes either from the driver or from the operator's own
declaration, and its ``source`` field says which.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil

logger = logging.getLogger(__name__)

MIB = 1024 * 1024

#: Vendors an operator may declare. ``cpu`` is deliberately absent: CPU engines are placed
#: by the node's CPU/RAM figures in ``NodeInventory``, not by a pretend GPU card.
KNOWN_VENDORS = frozenset(
    {"nvidia", "amd", "hygon", "ascend", "musa", "cambricon", "iluvatar", "metax"}
)

#: Decision: MPS (the CUDA Multi-Process Service) needs a Volta-or-newer card for its
#: per-client limits, but the control daemon itself runs on any CUDA card of compute
#: capability 3.5 or newer, on Linux only. We report the capability bit on that basis; the
#: scheduler decides whether to use it.
MPS_MIN_COMPUTE_CAPABILITY = (3, 5)

_DECLARED_FIELDS = frozenset(
    {"index", "uuid", "vendor", "model", "memory_mb", "compute_capability",
     "mig_capable", "mps_capable", "nvlink_peers"}
)
_CC_PATTERN = re.compile(r"^\d+\.\d+$")


@dataclass(frozen=True, slots=True)
class GpuCard:
    """One accelerator card on the node."""

    index: int
    uuid: str
    vendor: str  # one of KNOWN_VENDORS
    model: str
    memory_total_mb: int
    memory_used_mb: int
    compute_capability: str | None  # e.g. "8.6"; NVIDIA only
    mig_capable: bool
    mps_capable: bool
    temperature_c: int | None
    source: str  # "nvml" | "declared"
    # indices of this node's cards reachable over NVLink (the scheduler's topology scorer)
    nvlink_peers: tuple[int, ...] = ()
    # MIG mode is on now (NVML's current mode), so the card really is partitioned; None
    # when not read (declared cards: the declaration of mig_capable stands for it)
    mig_enabled: bool | None = None
    # % of the last sample period a kernel ran (NVML's utilization rate, 0-100): the
    # agent's /metrics and the server's card series; None when not read (declared cards,
    # MIG instances and vGPUs without the counter)
    utilization_pct: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (all fields, plain types)."""
        return dataclasses.asdict(self)


@dataclass(frozen=True, slots=True)
class NodeInventory:
    """Everything the heartbeat reports about the node's hardware."""

    gpus: tuple[GpuCard, ...]
    cpu_count: int
    memory_total_mb: int
    memory_available_mb: int
    cpu_percent: float
    memory_percent: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; ``gpus`` becomes a list of card dicts."""
        d = dataclasses.asdict(self)
        d["gpus"] = [card.to_dict() for card in self.gpus]
        return d


class NvmlMemoryInfo(Protocol):
    """What ``nvmlDeviceGetMemoryInfo`` returns (bytes)."""

    @property
    def total(self) -> int: ...

    @property
    def used(self) -> int: ...


class NvmlModule(Protocol):
    """The part of the ``pynvml`` API that discovery uses (real module or a test fake)."""

    @property
    def NVMLError(self) -> type[Exception]: ...

    @property
    def NVMLError_NotSupported(self) -> type[Exception]: ...

    @property
    def NVML_TEMPERATURE_GPU(self) -> int: ...

    @property
    def NVML_P2P_CAPS_INDEX_NVLINK(self) -> int: ...

    @property
    def NVML_P2P_STATUS_OK(self) -> int: ...

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any: ...
    def nvmlDeviceGetName(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetUUID(self, handle: Any) -> str | bytes: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> NvmlMemoryInfo: ...
    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]: ...
    def nvmlDeviceGetMigMode(self, handle: Any) -> Any: ...
    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int: ...
    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any: ...
    def nvmlDeviceGetP2PStatus(self, device1: Any, device2: Any, p2p_index: int) -> int: ...


def _text(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


class NvmlDiscovery:
    """Reads the NVIDIA cards through NVML; ``discover()`` is None when NVML is unusable."""

    def __init__(self, nvml: NvmlModule | None = None, *, platform: str = sys.platform) -> None:
        self._nvml = nvml
        self._platform = platform
        self._said_unavailable = False  # say it once per agent, not every heartbeat

    def _load(self) -> NvmlModule | None:
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                logger.info("pynvml is not installed; NVIDIA discovery disabled")
                return None
            self._nvml = pynvml
        return self._nvml

    def discover(self) -> list[GpuCard] | None:
        """The cards NVML sees, or None if NVML cannot be initialised.

        A card whose essential fields (handle, name, uuid, memory) cannot be read is
        skipped with a warning; the other cards are still returned. Optional fields
        (compute capability, MIG, temperature) degrade to None / False.
        """
        nvml = self._load()
        if nvml is None:
            return None
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            level = logging.DEBUG if self._said_unavailable else logging.INFO
            self._said_unavailable = True
            logger.log(level, "NVML unavailable (%s); no NVIDIA discovery", exc)
            return None
        try:
            try:
                count = nvml.nvmlDeviceGetCount()
            except nvml.NVMLError as exc:
                logger.warning("NVML initialised but the device count failed: %s", exc)
                return None
            cards = [self._read_card(nvml, i) for i in range(count)]
            found = [card for card in cards if card is not None]
            return self._with_nvlink(nvml, found)
        finally:
            try:
                nvml.nvmlShutdown()
            except nvml.NVMLError as exc:
                logger.debug("nvmlShutdown failed: %s", exc)

    def _read_card(self, nvml: NvmlModule, index: int) -> GpuCard | None:
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            name = _text(nvml.nvmlDeviceGetName(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            total_mb, used_mb = int(memory.total) // MIB, int(memory.used) // MIB
        except nvml.NVMLError as exc:
            logger.warning("NVML: skipping GPU %d: %s", index, exc)
            return None
        cc: tuple[int, int] | None
        try:
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            cc = (int(major), int(minor))
        except nvml.NVMLError as exc:
            logger.warning("NVML: GPU %d compute capability unknown: %s", index, exc)
            cc = None
        mps = cc is not None and cc >= MPS_MIN_COMPUTE_CAPABILITY
        mig_capable, mig_enabled = self._mig(nvml, handle, index)
        return GpuCard(
            index=index, uuid=uuid, vendor="nvidia", model=name,
            memory_total_mb=total_mb, memory_used_mb=used_mb,
            compute_capability=None if cc is None else f"{cc[0]}.{cc[1]}",
            mig_capable=mig_capable,
            mig_enabled=mig_enabled,
            mps_capable=mps and self._platform.startswith("linux"),
            temperature_c=self._temperature(nvml, handle, index),
            source="nvml",
            utilization_pct=self._utilization(nvml, handle, index),
        )

    @staticmethod
    def _with_nvlink(nvml: NvmlModule, cards: list[GpuCard]) -> list[GpuCard]:
        """Which pairs of cards reach each other over NVLink (P2P status per pair).

        Anything NVML cannot tell (no NVLink, an old driver or pynvml, an error) leaves
        the cards without peers: the topology scorer then treats them as PCIe.
        """
        if len(cards) < 2:
            return cards
        peers: dict[int, list[int]] = {c.index: [] for c in cards}
        try:
            handles = {c.index: nvml.nvmlDeviceGetHandleByIndex(c.index) for c in cards}
            link, ok = nvml.NVML_P2P_CAPS_INDEX_NVLINK, nvml.NVML_P2P_STATUS_OK
            for i, a in enumerate(cards):
                for b in cards[i + 1 :]:
                    if nvml.nvmlDeviceGetP2PStatus(handles[a.index], handles[b.index], link) == ok:
                        peers[a.index].append(b.index)
                        peers[b.index].append(a.index)
        except (nvml.NVMLError, AttributeError) as exc:
            logger.debug("NVML: NVLink topology unreadable (%s); cards reported as PCIe", exc)
            return cards
        return [dataclasses.replace(c, nvlink_peers=tuple(peers[c.index])) for c in cards]

    @staticmethod
    def _mig(nvml: NvmlModule, handle: Any, index: int) -> tuple[bool, bool]:
        """(the card supports MIG, MIG mode is on now). A real H200 answers ``[0, 0]``:
        capable but disabled, so not partitioned — QoS must not say gold for it."""
        try:
            mode = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as exc:
            if not isinstance(exc, nvml.NVMLError_NotSupported):
                logger.debug("NVML: GPU %d MIG mode unreadable (%s); not capable", index, exc)
            return False, False
        try:
            current = int(mode[0])
        except (TypeError, ValueError, IndexError):
            return True, False
        return True, current == 1  # NVML_DEVICE_MIG_ENABLE

    @staticmethod
    def _utilization(nvml: NvmlModule, handle: Any, index: int) -> int | None:
        try:
            return max(0, min(100, int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)))
        except (nvml.NVMLError, AttributeError, TypeError, ValueError) as exc:
            logger.debug("NVML: GPU %d utilization unreadable: %s", index, exc)
            return None

    @staticmethod
    def _temperature(nvml: NvmlModule, handle: Any, index: int) -> int | None:
        try:
            return int(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        except nvml.NVMLError as exc:
            logger.debug("NVML: GPU %d temperature unreadable: %s", index, exc)
            return None


def _bad(pos: int, name: str, problem: str) -> ValueError:
    return ValueError(f"declared GPU entry {pos}, field '{name}': {problem}")


def _int_field(entry: Mapping[str, Any], pos: int, name: str, minimum: int) -> int:
    value = entry[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(pos, name, f"must be an integer, got {value!r}")
    if value < minimum:
        raise _bad(pos, name, f"must be >= {minimum}, got {value}")
    return value


def _str_field(entry: Mapping[str, Any], pos: int, name: str) -> str:
    value = entry[name]
    if not isinstance(value, str) or not value.strip():
        raise _bad(pos, name, f"must be a non-empty string, got {value!r}")
    return value.strip()


def _bool_field(entry: Mapping[str, Any], pos: int, name: str) -> bool:
    value = entry.get(name, False)
    if not isinstance(value, bool):
        raise _bad(pos, name, f"must be true or false, got {value!r}")
    return value


def _declared_card(entry: Mapping[str, Any], pos: int) -> GpuCard:
    unknown = sorted(set(entry) - _DECLARED_FIELDS)
    if unknown:
        allowed = ", ".join(sorted(_DECLARED_FIELDS))
        raise _bad(pos, unknown[0], f"unknown field (allowed: {allowed})")
    for name in ("vendor", "model", "memory_mb"):
        if entry.get(name) is None:
            raise _bad(pos, name, "is required")
    index = _int_field(entry, pos, "index", 0) if entry.get("index") is not None else pos
    vendor = _str_field(entry, pos, "vendor").lower()
    if vendor not in KNOWN_VENDORS:
        known = ", ".join(sorted(KNOWN_VENDORS))
        raise _bad(pos, "vendor", f"unknown vendor {vendor!r} (known: {known})")
    cc = entry.get("compute_capability")
    if cc is not None and (not isinstance(cc, str) or not _CC_PATTERN.match(cc)):
        raise _bad(pos, "compute_capability",
                   f'must be a string like "8.6" (quote it in YAML), got {cc!r}')
    mig, mps = _bool_field(entry, pos, "mig_capable"), _bool_field(entry, pos, "mps_capable")
    if vendor != "nvidia":
        if cc is not None:
            raise _bad(pos, "compute_capability", "only NVIDIA cards have a compute capability")
        if mig or mps:
            raise _bad(pos, "mig_capable" if mig else "mps_capable",
                       "MIG/MPS sharing is reported for NVIDIA cards only")
    uuid = _str_field(entry, pos, "uuid") if entry.get("uuid") is not None else f"declared-{index}"
    peers = entry.get("nvlink_peers", [])
    if not isinstance(peers, list) or not all(
        isinstance(p, int) and not isinstance(p, bool) and p >= 0 and p != index for p in peers
    ):
        raise _bad(pos, "nvlink_peers",
                   f"must be a list of other cards' indices, got {peers!r}")
    return GpuCard(
        index=index, uuid=uuid, vendor=vendor, model=_str_field(entry, pos, "model"),
        memory_total_mb=_int_field(entry, pos, "memory_mb", 1), memory_used_mb=0,
        compute_capability=cc, mig_capable=mig, mps_capable=mps, temperature_c=None,
        source="declared", nvlink_peers=tuple(sorted(set(peers))),
    )


def declared_cards(config: Sequence[Mapping[str, Any]]) -> list[GpuCard]:
    """Parse the operator's declared GPU entries; ValueError names the entry and field.

    Entry fields: ``vendor`` (required, one of KNOWN_VENDORS, case-insensitive), ``model``
    (required), ``memory_mb`` (required, > 0), ``index`` (>= 0, defaults to the entry's
    position), ``uuid`` (defaults to ``declared-<index>``), ``compute_capability``
    (NVIDIA only, a string like "8.6"), ``mig_capable`` / ``mps_capable`` (NVIDIA only,
    default false), ``nvlink_peers`` (indices of the cards this one reaches over NVLink).
    Unknown fields are rejected so typos do not pass silently. Declared
    cards report ``memory_used_mb`` 0 and no temperature: nothing measures them.
    """
    if isinstance(config, str | bytes) or not isinstance(config, Sequence):
        raise ValueError(f"declared GPUs must be a list of entries, got {type(config).__name__}")
    cards: list[GpuCard] = []
    index_owner: dict[int, int] = {}
    uuid_owner: dict[str, int] = {}
    for pos, entry in enumerate(config):
        if not isinstance(entry, Mapping):
            raise ValueError(f"declared GPU entry {pos}: expected a mapping, "
                             f"got {type(entry).__name__}")
        card = _declared_card(entry, pos)
        if card.index in index_owner:
            raise _bad(pos, "index", f"duplicate index {card.index} "
                                     f"(already used by entry {index_owner[card.index]})")
        if card.uuid in uuid_owner:
            raise _bad(pos, "uuid", f"duplicate uuid {card.uuid!r} "
                                    f"(already used by entry {uuid_owner[card.uuid]})")
        index_owner[card.index] = pos
        uuid_owner[card.uuid] = pos
        cards.append(card)
    return cards


_warned_declared_ignored = False


def collect_inventory(declared: Sequence[GpuCard], nvml: NvmlDiscovery | None) -> NodeInventory:
    """The node inventory: NVML cards if discovery finds any, else the declared cards.

    When NVML finds cards and cards are also declared, the declaration is ignored and a
    warning is logged once per process. Host figures come from psutil; ``cpu_percent`` is
    the non-blocking reading (usage since the previous call; 0.0 on the very first).
    """
    global _warned_declared_ignored
    discovered = nvml.discover() if nvml is not None else None
    if discovered:
        gpus = tuple(discovered)
        if declared and not _warned_declared_ignored:
            _warned_declared_ignored = True
            logger.warning("NVML found %d GPU(s); ignoring the %d declared GPU(s) in the "
                           "agent config", len(discovered), len(declared))
    else:
        gpus = tuple(declared)
    memory = psutil.virtual_memory()
    return NodeInventory(
        gpus=gpus,
        cpu_count=int(psutil.cpu_count(logical=True) or 1),
        memory_total_mb=int(memory.total) // MIB,
        memory_available_mb=int(memory.available) // MIB,
        cpu_percent=float(psutil.cpu_percent(interval=None)),
        memory_percent=float(memory.percent),
    )


CONTAINERIZED_LABEL = "heteroflow.containerized"
# Files container runtimes leave at the root of a container's filesystem (Docker, Podman).
_CONTAINER_MARKERS = (".dockerenv", "run/.containerenv")


def node_labels(configured: Mapping[str, str], root: Path = Path("/")) -> dict[str, str]:
    """The labels the node reports: detected facts, then the operator's (which win).

    An agent that itself runs inside a container gets ``heteroflow.containerized: true``:
    its engines cannot get MIG/MPS isolation guarantees, so their QoS is bronze (H5).
    """
    detected: dict[str, str] = {}
    if any((root / marker).exists() for marker in _CONTAINER_MARKERS):
        detected[CONTAINERIZED_LABEL] = "true"
    return {**detected, **configured}
