"""Which engine a task runs: the selection chain of FEATURES H1 (spec 引擎选择链).

Order of decision:

1. explicit ``task.engine``, then the group label ``heteroflow.engine``;
2. a keyword in the image name (vllm, sglang, llamacpp/llama.cpp, trtllm/tensorrt-llm,
   mindie, vllm-mtt) -- counted as explicit too: it is the only way a fresh node can run an
   engine its probe has not yet reported;
3. the node's GPU-vendor chain (nvidia: vllm -> sglang -> llamacpp; amd/hygon: vllm ->
   llamacpp; musa: vllm-mtt; ascend: mindie; no GPU: llamacpp), overridable by the agent's
   ``engine_priorities``; the first engine the node reports available AND that runs on the
   node's vendor and cards wins.

Explicit choices skip the availability check (a wrong one fails visibly at the Docker
layer). TensorRT-LLM is never in a chain, not even when an override lists it (H3).

Card gates of the chain: vLLM on NVIDIA needs a card of compute capability >= 7.5 (C9,
the agent's probe rule); SGLang on NVIDIA needs > 7.5 (sm_75 and older lack its
CUTLASS/FlashInfer kernels, spec 已知边界 1). An NVIDIA node that reports no compute
capability passes neither gate: we do not guess.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from heteroflow.core.engines.registry import ENGINES

VENDOR_CHAINS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "nvidia": ("vllm", "sglang", "llamacpp"),
        "amd": ("vllm", "llamacpp"),
        "hygon": ("vllm", "llamacpp"),
        "musa": ("vllm-mtt",),
        "ascend": ("mindie",),
        # A node without GPUs: only a CPU-capable engine can run there.
        "": ("llamacpp",),
    }
)

# (minimum compute capability, whether the minimum itself is allowed) on NVIDIA cards.
_CHAIN_CC_GATES: Mapping[str, tuple[tuple[int, int], bool]] = MappingProxyType(
    {"vllm": ((7, 5), True), "sglang": ((7, 5), False)}
)


@dataclass(frozen=True)
class NodeEngines:
    """What a node's heartbeat says about engines (C1, C9)."""

    vendor: str
    compute_capabilities: tuple[str, ...] = ()
    available: Mapping[str, str] = field(default_factory=dict)
    priorities: tuple[str, ...] | None = None


@dataclass(frozen=True)
class EngineChoice:
    engine: str
    reason: str
    explicit: bool


class NoEngineAvailable(Exception):
    """The node's chain has no engine it can run; the message says what was tried."""


def parse_cc(raw: str) -> tuple[int, int] | None:
    """``"8.6"`` -> (8, 6); anything else -> None (an unreadable card counts as unknown)."""
    major, _, minor = raw.strip().partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        return None
    return int(major), int(minor or "0")


def best_cc(node: NodeEngines) -> tuple[int, int] | None:
    ccs = [cc for cc in map(parse_cc, node.compute_capabilities) if cc is not None]
    return max(ccs) if ccs else None


def cc_gate(node: NodeEngines, minimum: tuple[int, int], inclusive: bool) -> str | None:
    """None when some card meets the gate, else why not (for reasons and errors)."""
    best = best_cc(node)
    relation = ">=" if inclusive else ">"
    need = f"an NVIDIA card with compute capability {relation} {minimum[0]}.{minimum[1]}"
    if best is None:
        return f"needs {need} (node reports none)"
    if best > minimum or (inclusive and best == minimum):
        return None
    return f"needs {need} (best on node: {best[0]}.{best[1]})"


def vendor_chain(vendor: str, priorities: tuple[str, ...] | None = None) -> tuple[str, ...]:
    """The ordered chain for ``vendor``, or the agent's override of it.

    Unknown names and explicit-only engines (TensorRT-LLM) are dropped from an override,
    duplicates keep their first place; an unknown vendor without override has no chain.
    """
    names = VENDOR_CHAINS.get(vendor, ()) if priorities is None else priorities
    chain: list[str] = []
    for name in names:
        spec = ENGINES.get(name)
        if spec is not None and not spec.explicit_only and name not in chain:
            chain.append(name)
    return tuple(chain)


def unsupported_reason(engine: str, node: NodeEngines) -> str | None:
    """None when ``engine`` runs on the node's vendor and cards, else why it does not."""
    spec = ENGINES[engine]
    if node.vendor == "":
        return None if spec.cpu_capable else "needs a GPU (node has none)"
    if node.vendor not in spec.vendors:
        return f"does not run on {node.vendor} cards"
    gate = _CHAIN_CC_GATES.get(engine)
    if node.vendor == "nvidia" and gate is not None:
        return cc_gate(node, *gate)
    return None


# Order matters: "vllm-mtt" images contain "vllm"; trtllm before anything generic.
_IMAGE_KEYWORDS: tuple[tuple[str, str], ...] = (
    ("tensorrt-llm", "trtllm"),
    ("trtllm", "trtllm"),
    ("vllm-mtt", "vllm-mtt"),
    ("vllm-musa", "vllm-mtt"),
    ("vllm_musa", "vllm-mtt"),
    ("sglang", "sglang"),
    ("llama.cpp", "llamacpp"),
    ("llamacpp", "llamacpp"),
    ("llama-cpp", "llamacpp"),
    ("mindie", "mindie"),
    ("vllm", "vllm"),
)
# Moore Threads publishes its vLLM as registry.mthreads.com/.../vllm/vllm-openai:<tag>
# (MooreThreads/vllm-musa docker/README.md): plain "vllm" there means vllm-mtt.
_MUSA_MARKERS = ("mthreads", "musa")


def engine_from_image(image: str) -> str:
    """The engine an image name names, or "" when it names none (the digest is ignored)."""
    name = image.lower().split("@", 1)[0]
    for keyword, engine in _IMAGE_KEYWORDS:
        if keyword in name:
            if engine == "vllm" and any(marker in name for marker in _MUSA_MARKERS):
                return "vllm-mtt"
            return engine
    return ""


_LEFT_TO_NODE = "no engine named; left to the node's selection chain"


def select_engine(
    *, explicit: str, label: str, image: str, node: NodeEngines | None
) -> EngineChoice:
    """Apply the chain; NoEngineAvailable when the node can run none of its engines."""
    if explicit:
        return EngineChoice(explicit, "explicit task.engine", True)
    if label:
        return EngineChoice(label, "label heteroflow.engine", True)
    by_image = engine_from_image(image)
    if by_image:
        return EngineChoice(by_image, f"image name {image!r} names {by_image}", True)
    if node is None:
        return EngineChoice("", _LEFT_TO_NODE, False)
    chain = vendor_chain(node.vendor, node.priorities)
    source = "agent engine_priorities" if node.priorities is not None else "vendor chain"
    where = node.vendor or "CPU-only"
    skipped: list[str] = []
    for engine in chain:
        if engine not in node.available:
            skipped.append(f"{engine}: not reported available")
            continue
        why_not = unsupported_reason(engine, node)
        if why_not is not None:
            skipped.append(f"{engine}: {why_not}")
            continue
        reason = f"first available engine of the {where} {source} ({' -> '.join(chain)})"
        if skipped:
            reason += f"; skipped {'; '.join(skipped)}"
        return EngineChoice(engine, reason, False)
    reported = ", ".join(sorted(node.available)) or "none"
    wanted = " -> ".join(chain) or "an empty chain"
    detail = f": {'; '.join(skipped)}" if skipped else ""
    raise NoEngineAvailable(
        f"no usable engine on this {where} node: the {source} wants {wanted}{detail} "
        f"(node reports available: {reported}; compute capabilities: "
        f"{', '.join(node.compute_capabilities) or 'none'})"
    )


def resolve_engine(explicit: str, label: str, image: str) -> tuple[str, str]:
    """(engine, why) without a node: explicit, label or image keyword, else ""."""
    choice = select_engine(explicit=explicit, label=label, image=image, node=None)
    return choice.engine, choice.reason
