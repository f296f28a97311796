"""Readable pending reasons (B2, B5): one sentence that counts nodes per cause."""

from __future__ import annotations

from heteroflow.core.placement import filters as f
from heteroflow.core.placement.model import DEFAULT_CPU_TASK_MEMORY_MB, TaskDemand


def explain(t: TaskDemand, seen: int, counts: dict[str, int], thr: float, cap: int) -> str:
    if not seen:
        return "InsufficientResources: no node has registered"
    cards = f"{t.gpu_required} card(s)"
    labels = {
        f.OFFLINE: "offline",
        f.RESERVED: "dedicated to other tenants",
        f.PROCESS_RUNTIME: "process runtime (it runs only the platform's llama.cpp "
        "launcher and, where its agent has one, vLLM — never a custom command or another "
        f"engine's image: {t.engine or 'this'} needs a Docker node)",
        f.VOLUME: f"model_path {t.model_path!r} outside the node's allowed volume prefixes",
        f.NO_GPUS: "no GPU cards",
        f.TYPE_MISMATCH: f"no card of type {t.gpu_type!r}",
        f.PORTS: "requested host port in use or port pool exhausted",
        f.ENGINE_VENDOR: f"cards of a vendor the engine {t.engine or '?'} does not run on",
        f.CROSS_TENANT: "cards hold another tenant's work (a card is shared only inside "
        "one tenant or sharing group)",
        f.KIND_MIX: "cards hold work of another kind (inference never shares a card with "
        "training or plain containers)",
        f.WHOLE_BUSY: f"fewer than {cards} wholly free (tensor-parallel and non-inference "
        "work take whole cards)",
        f.VRAM_SHORT: f"fewer than {cards} with {t.estimated_gpu_memory_mb} MB free after "
        "the reservation",
        f.OVERLOADED: f"CPU or memory use above {thr:g}%",
        f.CONTAINER_CAP: f"already {cap} inference containers (sleeping services count)",
        f.COMMITMENT_FULL: f"fewer than {cards} with {t.gpu_memory_utilization}% of memory "
        "commitment left",
        f.MEMORY_SHORT: f"not {t.memory_mb or DEFAULT_CPU_TASK_MEMORY_MB} MB of free memory "
        "for a CPU task",
        f.HOST_VOLUME: "a task.volumes host path outside the node's allowed volume prefixes",
        f.NO_MOUNTS: "process runtime (it mounts nothing: task.volumes need a Docker node)",
    }
    parts = [f"{n} node(s): {labels[k]}" for k, n in sorted(counts.items())]
    return f"InsufficientResources: 0/{seen} nodes fit — " + "; ".join(parts)
