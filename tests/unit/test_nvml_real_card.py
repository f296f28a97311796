"""NVML discovery replayed from a real card's answers (issue 10's device check).

``tests/data/nvml/h200.json`` holds what NVML answered on a lent NVIDIA H200 machine
(``scripts/device-check-nvml.py``), raw, and what ``NvmlDiscovery`` made of it there.
Replaying the raw answers through the fake NVML must give the same card here — and the
real card taught one rule: MIG *capable* is not MIG *enabled* ([0, 0] = disabled), so
the card is not partitioned and its QoS is not gold.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.inventory import NvmlDiscovery
from heteroflow.core.placement.model import CardView, NodeView
from heteroflow.core.placement.scoring import qos
from heteroflow.testing.fake_nvml import FakeNvml

DATA = Path(__file__).parents[1] / "data" / "nvml" / "h200.json"


def recorded() -> dict[str, Any]:
    return dict(json.loads(DATA.read_text()))


def replay(raw: dict[str, Any], *, mig_on: bool = False) -> FakeNvml:
    return FakeNvml.from_recorded(raw, mig_on=mig_on)


@pytest.mark.feature("C1")
def test_the_recorded_h200_is_discovered_as_it_was_on_the_real_machine() -> None:
    data = recorded()
    cards = NvmlDiscovery(replay(data["raw"]), platform="linux").discover()
    assert cards is not None
    got = [c.to_dict() for c in cards]
    want = data["discovered"]
    keys = ("model", "uuid", "memory_total_mb", "memory_used_mb", "compute_capability",
            "mig_capable", "mps_capable", "temperature_c")
    assert [{k: g[k] for k in keys} for g in got] == [{k: w[k] for k in keys} for w in want]
    assert got[0]["memory_total_mb"] == 143771  # nvidia-smi said 143771 MiB
    assert got[0]["mig_enabled"] is False  # NVML answered [0, 0]: MIG mode disabled


@pytest.mark.feature("H5")
@pytest.mark.parametrize(("mig_on", "level"), [(False, "silver"), (True, "gold")])
def test_a_mig_capable_card_is_gold_only_while_mig_mode_is_on(mig_on: bool, level: str) -> None:
    """The device check found QoS 'gold' on an H200 whose MIG mode was off: a promise of
    partitioning that did not exist. Gold now needs MIG on; MPS gives silver."""
    card = NvmlDiscovery(replay(recorded()["raw"], mig_on=mig_on), platform="linux").discover()
    assert card is not None
    c = card[0]
    view = CardView(index=c.index, vendor=c.vendor, model=c.model,
                    memory_total_mb=c.memory_total_mb, mig=bool(c.mig_enabled),
                    mps=c.mps_capable)
    node = NodeView(id="n", name="n", online=True, cards=[view], cpu_count=16,
                    memory_total_mb=131072)
    assert qos(node, [view]) == level
