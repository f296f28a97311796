#!/usr/bin/env python3
"""Run on a machine with NVIDIA GPUs: what NVML answers, raw, beside what the agent's
``NvmlDiscovery`` makes of it, the one-click chain and QoS the platform would derive.

    PYTHONPATH=src python3 scripts/device-check-nvml.py > nvml.json

Needs only ``pynvml`` (nvidia-ml-py) and ``psutil``; the last line is one JSON object.
The printed raw values are what ``tests/data/nvml/*.json`` record from real cards, so the
unit tests can replay them through a fake NVML.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pynvml

from heteroflow.agent.inventory import NvmlDiscovery, collect_inventory
from heteroflow.core.engines.selection import NodeEngines
from heteroflow.core.engines.templates import inference_templates
from heteroflow.core.placement.model import CardView, NodeView
from heteroflow.core.placement.scoring import qos


def _call(fn: Any, *args: Any) -> Any:
    try:
        value = fn(*args)
    except pynvml.NVMLError as exc:
        return {"error": type(exc).__name__, "text": str(exc)}
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, tuple | list):
        return list(value)
    if hasattr(value, "total"):
        return {"total": int(value.total), "used": int(value.used)}
    return value


def raw() -> dict[str, Any]:
    pynvml.nvmlInit()
    try:
        out: dict[str, Any] = {
            "driver": _call(pynvml.nvmlSystemGetDriverVersion),
            "nvml": _call(pynvml.nvmlSystemGetNVMLVersion),
            "cards": [],
        }
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            out["cards"].append(
                {
                    "index": i,
                    "name": _call(pynvml.nvmlDeviceGetName, h),
                    "uuid": _call(pynvml.nvmlDeviceGetUUID, h),
                    "memory": _call(pynvml.nvmlDeviceGetMemoryInfo, h),
                    "compute_capability": _call(pynvml.nvmlDeviceGetCudaComputeCapability, h),
                    "mig_mode": _call(pynvml.nvmlDeviceGetMigMode, h),
                    "temperature": _call(
                        pynvml.nvmlDeviceGetTemperature, h, pynvml.NVML_TEMPERATURE_GPU
                    ),
                    # the gpu rate (an int %), or the error NVML answered (MIG, vGPU)
                    "utilization": _call(lambda d: pynvml.nvmlDeviceGetUtilizationRates(d).gpu, h),
                }
            )
        return out
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,memory.total,compute_cap,mig.mode.current",
             "--format=csv,noheader"],
            capture_output=True, text=True, check=False,
        ).stdout.strip()
    except FileNotFoundError:
        smi = "nvidia-smi not found"
    cards = NvmlDiscovery().discover()
    inventory = collect_inventory((), NvmlDiscovery())
    engines = NodeEngines(
        vendor="nvidia",
        compute_capabilities=tuple(c.compute_capability or "" for c in cards or ()),
        available={"vllm": "vllm/vllm-openai:v0.11.0", "sglang": "lmsysorg/sglang:latest",
                   "llamacpp": "ghcr.io/ggml-org/llama.cpp:server-cuda"},
    )
    views = [
        CardView(index=c.index, vendor=c.vendor, model=c.model,
                 memory_total_mb=c.memory_total_mb, memory_used_mb=c.memory_used_mb,
                 mig=c.mig_capable, mps=c.mps_capable)
        for c in cards or ()
    ]
    node = NodeView(id="node-1", name="device", online=True, cards=views, cpu_count=16,
                    memory_total_mb=inventory.memory_total_mb)
    result = {
        "nvidia_smi": smi,
        "raw": raw(),
        "discovered": [c.to_dict() for c in cards or ()],
        "inventory_gpus": len(inventory.gpus),
        "one_click_chain": [t.engine for t in inference_templates(engines)],
        "qos": qos(node, views) if views else None,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
