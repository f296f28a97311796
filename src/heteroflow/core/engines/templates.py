"""One-click inference templates for a node (FEATURES H2, spec 控制面一键建服务的引擎选择).

The template chain is vllm -> sglang -> llamacpp, filtered by what the node's heartbeat
reports available and by its cards:

* vllm: an NVIDIA card of compute capability >= 7.0 (H2's rule; the agent's probe is
  stricter, >= 7.5 per C9, so in practice a 7.0 card is never reported available);
* sglang: an NVIDIA card newer than sm_75 (> 7.5; spec 已知边界 1);
* llamacpp: any node, CPU-only included (old cards such as the P100, 6.0, land here).

The image of a template is exactly the ref the node reported; nothing is ever invented,
and a node that fits no engine gets ``[]`` so the caller fails before creating anything.
TensorRT-LLM is explicit-only and never appears (H3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from heteroflow.core.engines.registry import ENGINES
from heteroflow.core.engines.selection import NodeEngines, cc_gate, unsupported_reason


@dataclass(frozen=True)
class Template:
    engine: str
    image: str
    reason: str


def _nvidia_cc(minimum: tuple[int, int], inclusive: bool) -> Callable[[NodeEngines], str | None]:
    def gate(node: NodeEngines) -> str | None:
        if node.vendor != "nvidia":
            return "needs an NVIDIA card"
        return cc_gate(node, minimum, inclusive)

    return gate


def _runs_on_node(node: NodeEngines) -> str | None:
    return unsupported_reason("llamacpp", node)


TEMPLATE_CHAIN: tuple[tuple[str, Callable[[NodeEngines], str | None]], ...] = (
    ("vllm", _nvidia_cc((7, 0), inclusive=True)),
    ("sglang", _nvidia_cc((7, 5), inclusive=False)),
    ("llamacpp", _runs_on_node),
)


def inference_templates(node: NodeEngines) -> list[Template]:
    """The usable templates in chain order (first = recommended), or ``[]``."""
    templates: list[Template] = []
    for engine, gate in TEMPLATE_CHAIN:
        if ENGINES[engine].explicit_only or engine not in node.available:
            continue
        if gate(node) is not None:
            continue
        cards = ", ".join(node.compute_capabilities) or "no GPU"
        templates.append(
            Template(
                engine=engine,
                image=node.available[engine],
                reason=f"{engine} reported available by the node; fits its cards ({cards})",
            )
        )
    return templates
