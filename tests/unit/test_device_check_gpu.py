"""The prepared GPU check (scripts/device-check-gpu.py) runs here on recorded answers.

A lent GPU machine is drawn by chance and for minutes: the check must work the first
time it meets a card. Replaying what NVML answered on a real H200 runs every step that
needs no card — discovery, the scheduler's placement with the reservation — through the
same script, as a process, so that an import or a changed signature breaks here first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "scripts" / "device-check-gpu.py"
H200 = ROOT / "tests" / "data" / "nvml" / "h200.json"


def run_check(*args: str) -> tuple[int, dict[str, object]]:
    env = os.environ | {"PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
        timeout=120, check=False,
    )
    return done.returncode, json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.feature("H10")
def test_the_gpu_check_places_on_the_recorded_h200_as_the_scheduler_does() -> None:
    rc, out = run_check("--replay", str(H200))
    assert rc == 0, out
    assert out["mode"] == "replay"
    cards = out["discovery"]["cards"]  # type: ignore[index]
    assert [c["model"] for c in cards] == ["NVIDIA H200"]
    p = out["placement"]
    assert isinstance(p, dict)
    # two replicas at 45 % stack on the one card; a third would pass 100 %
    assert p["first"]["gpu_ids"] == [0] and p["stacked"]["gpu_ids"] == [0]
    assert p["card0"]["committed_pct"] == 90
    assert p["third"]["placed"] is False and "free after the reservation" in p["third"]["reason"]
    # whole-card training never shares a card that inference holds (B6)
    assert "another kind" in p["training"]["reason"]
    assert p["reservation_mb"] == [500 + 143771 // 10]
    assert out["launch"] == {"ran": False, "why": "replay: no card to launch on"}


def test_without_a_card_the_check_says_so_and_fails(tmp_path: Path) -> None:
    empty = tmp_path / "none.json"
    empty.write_text(json.dumps({"raw": {"cards": []}}))
    rc, out = run_check("--replay", str(empty))
    assert rc == 1
    assert out["ok"] is False and out["why"] == "no NVIDIA card found"
