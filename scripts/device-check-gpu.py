#!/usr/bin/env python3
"""The platform's GPU path against a real NVIDIA card, in one short run (issue 28, item 6).

On a lent GPU machine (the device tool; it reaches no package index, so
``scripts/device-prepare.sh`` gathers the few wheels it lacks beforehand):

    bash scripts/device-check-gpu.sh              # runs this with the carried wheels

Here, on the answers NVML gave on a real card (what a unit test runs):

    python3 scripts/device-check-gpu.py --replay tests/data/nvml/h200.json

Steps, each reported (the last line is one JSON object):

1. ``discovery``: what NVML answers and what the agent's ``NvmlDiscovery`` makes of it.
2. ``placement``: the scheduler's own pipeline (``core.placement.place``) on a node of
   the discovered cards with the B3 reservation: an inference replica at 45 % of a card,
   a second of the same tenant stacking on it, a third refused (the card's commitment
   would pass 100 %), and whole-card training refused while inference holds the card.
3. ``launch``: the agent's process environment for the first placement
   (``agent.launch.task_env``) given to a child Python that reports what CUDA shows it
   and allocates the memory the placement booked, while NVML measures the card: the
   child must see exactly the placed card, and the card must keep the reservation free.
4. ``engines``: which GPU engines this machine has (none can be installed without a
   package index; a CUDA build of vLLM or SGLang is gigabytes, beyond what can be
   carried) — a real GPU service runs through the platform only where one is present.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from heteroflow.agent.inventory import GpuCard, NvmlDiscovery
from heteroflow.core.placement.model import (
    CardView,
    NodeView,
    Placement,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
)
from heteroflow.core.placement.pipeline import place

ROOT = Path(__file__).resolve().parents[1]
POOL = range(41000, 41100)
SHARE_PCT = 45  # each stacked replica's gpu_memory_utilization
CHILD_TIMEOUT_S = 180

_CHILD = """
import json, os, sys, time
import torch
want_mb = int(sys.argv[1])
out = {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
       "device_count": torch.cuda.device_count()}
if out["device_count"]:
    out["name"] = torch.cuda.get_device_name(0)
    block = torch.empty(want_mb * 1024 * 1024, dtype=torch.uint8, device="cuda:0")
    torch.cuda.synchronize()
    out["allocated_mb"] = block.numel() // (1024 * 1024)
print(json.dumps(out), flush=True)
sys.stdin.readline()  # hold the memory until the parent has measured the card
"""


def _nvml(replay: Path | None) -> Any:
    if replay is None:
        import pynvml

        return pynvml
    from heteroflow.testing.fake_nvml import FakeNvml

    return FakeNvml.from_recorded(json.loads(replay.read_text())["raw"])


def _view(c: GpuCard) -> CardView:
    return CardView(
        index=c.index, vendor=c.vendor, model=c.model, memory_total_mb=c.memory_total_mb,
        memory_used_mb=c.memory_used_mb, mig=bool(c.mig_enabled), mps=c.mps_capable,
    )


def _demand(name: str, card: CardView, *, training: bool = False) -> TaskDemand:
    return TaskDemand(
        task_id=name, gpu_required=1, gpu_type=card.model,
        gpu_memory_utilization=100 if training else SHARE_PCT,
        estimated_gpu_memory_mb=card.memory_total_mb * SHARE_PCT // 100 * 9 // 10,
        memory_mb=1024, host_ports=(0,), task_type="training" if training else "inference",
        engine="" if training else "vllm", share_key="tn-check", tenant_id="tn-check",
        engine_vendors=frozenset({"nvidia"}),
    )


def placement(cards: list[GpuCard]) -> tuple[dict[str, Any], Placement | None]:
    node = NodeView(
        id="nd-device", name="device", online=True, cards=[_view(c) for c in cards],
        cpu_count=os.cpu_count() or 1, memory_total_mb=128 * 1024, runtime="process",
        engines=frozenset({"vllm"}),
    )
    res = Reservation()
    steps: dict[str, Any] = {"reservation_mb": [res.of(c.memory_total_mb) for c in cards]}
    first: Placement | None = None
    for name, training in (("first", False), ("stacked", False), ("third", False),
                           ("training", True)):
        t = _demand(name, node.cards[0], training=training)
        p = place(t, [node], res, POOL)
        if isinstance(p, Unplaced):
            steps[name] = {"placed": False, "reason": p.reason}
            continue
        book(node, p, t)
        first = first or p
        steps[name] = {"placed": True, "gpu_ids": list(p.gpu_ids),
                       "per_card_mb": p.per_card_mb, "per_card_pct": p.per_card_pct}
    c0 = node.cards[0]
    steps["card0"] = {"committed_pct": c0.committed_pct, "committed_mb": c0.committed_mb}
    steps["ok"] = (
        steps["first"].get("gpu_ids") == [0] and steps["stacked"].get("gpu_ids") == [0]
        and not steps["third"]["placed"] and not steps["training"]["placed"]
    )
    return steps, first


def launch(p: Placement, nvml: Any) -> dict[str, Any]:
    """The agent's environment for the placement, and a child that uses the card."""
    if importlib.util.find_spec("torch") is None:
        return {"ran": False, "why": "no torch on this machine to play the engine's part"}
    from heteroflow.agent.launch import task_env
    from heteroflow.schemas.nodes import TaskAssignment

    t = TaskAssignment(
        id="task-check", group_id="tg-check", name="check-0", status="starting",
        task_type="inference", model_name="check", model_path="", image="", engine="vllm",
        command=[], engine_args=[], env=[], ports=[], gpu_ids=list(p.gpu_ids),
        gpu_required=len(p.gpu_ids), memory_mb=1024, health_check={},
    )
    env = task_env(t) | {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(p.per_card_mb)], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        seen: dict[str, Any] = json.loads(child.stdout.readline() or "{}")
        seen["start_to_allocated_s"] = round(time.monotonic() - started, 2)
        handle = nvml.nvmlDeviceGetHandleByIndex(p.gpu_ids[0])
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        total_mb, free_mb = info.total // 2**20, info.free // 2**20
        seen["card_free_mb_while_held"] = free_mb
        seen["reservation_kept"] = free_mb >= Reservation().of(total_mb)
        child.stdin.write("\n")
        child.stdin.flush()
        child.wait(timeout=CHILD_TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
        err = (child.stderr.read() if child.stderr else "")[-2000:]
    seen["ran"] = True
    seen["ok"] = (
        seen.get("CUDA_VISIBLE_DEVICES") == ",".join(map(str, p.gpu_ids))
        and seen.get("device_count") == len(p.gpu_ids)
        and seen.get("allocated_mb") == p.per_card_mb and seen["reservation_kept"]
    )
    if not seen["ok"] and err:
        seen["stderr_tail"] = err
    return seen


def engines() -> dict[str, Any]:
    found = {
        "vllm": importlib.util.find_spec("vllm") is not None,
        "sglang": importlib.util.find_spec("sglang") is not None,
        "llama-server": shutil.which("llama-server") is not None,
        "trtllm-serve": shutil.which("trtllm-serve") is not None,
    }
    note = "" if any(found.values()) else (
        "no GPU engine on this machine and no package index to install one; a real GPU "
        "service through the platform waits for a machine that has one"
    )
    return {"present": found, "note": note}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    ap.add_argument("--replay", type=Path, help="recorded NVML answers instead of a card")
    args = ap.parse_args(argv)
    nvml = _nvml(args.replay)
    started = time.monotonic()
    cards = NvmlDiscovery(nvml, platform="linux").discover() or []
    out: dict[str, Any] = {
        "mode": "replay" if args.replay else "device",
        "discovery": {"cards": [c.to_dict() for c in cards]},
    }
    if not cards:
        out["ok"] = False
        out["why"] = "no NVIDIA card found"
        print(json.dumps(out))
        return 1
    out["placement"], first = placement(cards)
    if args.replay or first is None:
        out["launch"] = {"ran": False, "why": "replay: no card to launch on"
                         if args.replay else "nothing was placed"}
    else:
        nvml.nvmlInit()
        try:
            out["launch"] = launch(first, nvml)
        finally:
            nvml.nvmlShutdown()
    out["engines"] = engines()
    out["seconds"] = round(time.monotonic() - started, 2)
    out["ok"] = bool(out["placement"]["ok"]) and out["launch"].get("ok", True) is not False
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
