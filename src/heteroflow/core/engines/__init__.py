"""Engines as data: registry, selection chain, one-click templates and exact command lines.

``registry`` says what each engine is (vendors, ports, health, metrics, shapes);
``selection`` picks the engine of a task (FEATURES H1, H3); ``templates`` lists a node's
one-click templates (H2); ``commands`` builds the command line per engine and shape (H4,
G1, G2), with ``kv_offload`` for vLLM's CPU KV offload flags (C12); ``flags`` records each
engine's real CLI flags, against which the tests check the builder; ``context`` reads the
context an engine runs with from its arguments (the memory estimate). All pure: no I/O.
"""

from __future__ import annotations

from heteroflow.core.engines.commands import (
    LLAMACPP_AGENT_FLAGS,
    CommandError,
    EngineCommand,
    LaunchShape,
    build_command,
    owned_flag_in,
    process_argv,
)
from heteroflow.core.engines.context import ContextFlag, EngineContext
from heteroflow.core.engines.registry import ENGINES, EngineSpec, engine_context, engine_spec
from heteroflow.core.engines.selection import (
    VENDOR_CHAINS,
    EngineChoice,
    NodeEngines,
    NoEngineAvailable,
    engine_from_image,
    resolve_engine,
    select_engine,
    vendor_chain,
)
from heteroflow.core.engines.templates import Template, inference_templates

# Engines that can run without a GPU (gpu_required: 0).
CPU_CAPABLE = frozenset(name for name, spec in ENGINES.items() if spec.cpu_capable)

__all__ = [
    "CPU_CAPABLE",
    "ENGINES",
    "LLAMACPP_AGENT_FLAGS",
    "VENDOR_CHAINS",
    "CommandError",
    "ContextFlag",
    "EngineChoice",
    "EngineCommand",
    "EngineContext",
    "EngineSpec",
    "LaunchShape",
    "NoEngineAvailable",
    "NodeEngines",
    "Template",
    "build_command",
    "engine_context",
    "engine_from_image",
    "engine_spec",
    "inference_templates",
    "owned_flag_in",
    "process_argv",
    "resolve_engine",
    "select_engine",
    "vendor_chain",
]
