"""What a task's container looks like: pure decisions shared by the dry run and runtimes.

Owns FEATURES C3 (environment rules), C5 (shared memory / IPC / host network for
multi-GPU and pipeline containers), the per-vendor GPU runtime arguments and the
model mount (C4's shape; the allow-list check itself runs on the node, where the
files are). The Docker runtime turns a ``ContainerPlan`` into Engine API calls; the
dry run shows it as it is.

GPU arguments per vendor (the spec's table was lost; rebuilt from the vendors' docs):
- nvidia: a device request for the assigned card ids with capability ``gpu`` (what
  ``docker run --gpus '"device=0,1"'`` sends).
- amd / hygon (ROCm / DTK): ``/dev/kfd`` + ``/dev/dri`` and groups ``video``, ``render``;
  visibility through ``HIP_VISIBLE_DEVICES``.
- ascend: ``/dev/davinci{N}`` per card plus ``/dev/davinci_manager``, ``/dev/devmm_svm``,
  ``/dev/hisi_hdc``; ``ASCEND_VISIBLE_DEVICES``.
- musa (Moore Threads): the MT container toolkit reads ``MTHREADS_VISIBLE_DEVICES``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from heteroflow.core.engine_access import KEY_ENV
from heteroflow.core.gang import GANG_ENV

DATA_MODELS = "/data/models"
# engines whose model_path names a directory inside their image, never a host path
MODEL_IN_IMAGE = frozenset({"trtllm"})
SHM_SIZE = "16g"
VLLM_FAMILY = frozenset({"vllm", "vllm-mtt"})

# Variables the agent owns: user values with these names are dropped (C3).
AGENT_OWNED_ENV = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "NVIDIA_VISIBLE_DEVICES",
        "HIP_VISIBLE_DEVICES",
        "ROCR_VISIBLE_DEVICES",
        "ASCEND_RT_VISIBLE_DEVICES",
        "ASCEND_VISIBLE_DEVICES",
        "MUSA_VISIBLE_DEVICES",
        "MTHREADS_VISIBLE_DEVICES",
        "HETEROFLOW_TASK_ID",
        "HETEROFLOW_GROUP_ID",
        "HETEROFLOW_TASK_NAME",
        "VLLM_SERVER_DEV_MODE",
    }
) | frozenset(KEY_ENV.values()) | GANG_ENV  # C14: the engine's key; G1: a gang's ranks

# Never settable by a user, whatever an operator adds to the allow-list: the dynamic
# loader, interpreter start-up hooks (a Python, Perl, Ruby, Node, JVM or shell that
# reads them runs code before the engine does), proxy and browser hooks (``BROWSER``
# is run by Python's webbrowser module; proxies redirect the engine's downloads),
# GPU-runtime capability switches (``NVIDIA_DRIVER_CAPABILITIES=all`` mounts more of
# the host's driver) and anything of the platform's own (``HETEROFLOW_*``).
DENIED_ENV_PREFIXES = (
    "LD_",
    "DYLD_",
    "GLIBC_",
    "MALLOC_",
    "PYTHON",
    "PERL",
    "RUBY",
    "NODE_",
    "JAVA_",
    "_JAVA_",
    "JDK_",
    "BASH_",
    "NVIDIA_",
    "HETEROFLOW_",
)
DENIED_ENV = frozenset(
    {
        "ENV",
        "SHELLOPTS",
        "PROMPT_COMMAND",
        "PS4",
        "IFS",
        "PATH",
        "HOME",
        "SHELL",
        "GCONV_PATH",
        "HOSTALIASES",
        "LOCALDOMAIN",
        "RES_OPTIONS",
        "NLSPATH",
        "TMPDIR",
        "BROWSER",
        "EDITOR",
        "VISUAL",
        "PAGER",
        "GIT_ASKPASS",
        "SSH_ASKPASS",
        "GIT_SSH_COMMAND",
        "GIT_CONFIG_GLOBAL",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "FTP_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "REQUESTS_CA_BUNDLE",
        "SSL_CERT_FILE",
        "SSL_CERT_DIR",
        "CURL_CA_BUNDLE",
        "OPENSSL_CONF",
        "OPENSSL_MODULES",
        "OPENSSL_ENGINES",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "TORCHINDUCTOR_CACHE_DIR",  # compiled kernels are loaded from it
        "TRITON_CACHE_DIR",
    }
)

# What a user may set: the engines' own knobs and the libraries under them. An operator
# extends it with names or ``PREFIX*`` patterns (``HETEROFLOW_TASK_ENV_ALLOW``).
DEFAULT_ENV_ALLOW = (
    "VLLM_*",
    "SGLANG_*",
    "SGL_*",
    "GGML_*",
    "TRTLLM_*",
    "TLLM_*",
    "MINDIE_*",
    "MIES_*",
    "ATB_*",
    "HCCL_*",
    "ASCEND_*",
    "MUSA_*",
    "MCCL_*",
    "NCCL_*",
    "RCCL_*",
    "CUDA_*",
    "CUBLAS_*",
    "HIP_*",
    "MIOPEN_*",
    "HSA_*",
    "TORCH_*",
    "PYTORCH_*",
    "HF_*",
    "HUGGING_FACE_*",
    "TRANSFORMERS_*",
    "TOKENIZERS_*",
    "OMP_*",
    "MKL_*",
    "OPENBLAS_*",
    "KMP_*",
    "RAY_*",
    "LANG",
    "LC_*",
    "TZ",
)


def env_denied(name: str) -> bool:
    """True for names no one may set (the deny-list above; case-insensitive, since
    libraries read both ``http_proxy`` and ``HTTP_PROXY``)."""
    upper = name.upper()
    return upper in DENIED_ENV or upper.startswith(DENIED_ENV_PREFIXES)


def env_allowed(name: str, allow: Sequence[str] = DEFAULT_ENV_ALLOW) -> bool:
    """A user variable passes when the allow-list names it and the deny-list does not."""
    if env_denied(name):
        return False
    return any(
        name.startswith(p[:-1]) if p.endswith("*") else name == p for p in allow
    )


def env_problem(item: str, allow: Sequence[str] = DEFAULT_ENV_ALLOW) -> str:
    """Why a ``NAME=value`` item of ``task.env`` is refused ("" when it is fine)."""
    name = item.split("=", 1)[0]
    if "=" not in item:
        return ""  # a bare name is dropped (C3), not refused
    if not ENV_NAME.match(name):
        return f"{name!r} is not a valid variable name"
    if name in AGENT_OWNED_ENV:
        return ""  # dropped: the agent sets it (C3)
    if env_denied(name):
        return f"{name} may never be set: it changes how programs start or what they trust"
    if not env_allowed(name, allow):
        return (
            f"{name} is not in the allowed variables ({', '.join(allow)}); a platform "
            "operator can extend the list (HETEROFLOW_TASK_ENV_ALLOW)"
        )
    return ""


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")

# The whole environment an engine on the process runtime starts with (never the
# agent's or the server's own), before the task's variables.
PROCESS_BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class GpuRequest:
    vendor: str
    device_ids: tuple[str, ...] = ()  # nvidia device request
    devices: tuple[str, ...] = ()  # host device paths passed through
    group_add: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ContainerSecurity:
    """How a task's container is confined. Every container gets it: a task's image,
    command and environment are a tenant member's, so the container is the boundary.

    No ``--privileged``; every capability dropped except the few an image's entrypoint
    needs to set up files and drop to its own user; ``no-new-privileges`` so a setuid
    binary in the image cannot gain more; a bounded number of processes.
    """

    privileged: bool = False
    cap_drop: tuple[str, ...] = ("ALL",)
    cap_add: tuple[str, ...] = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "SETGID", "SETUID")
    security_opt: tuple[str, ...] = ("no-new-privileges:true",)
    pids_limit: int = 16384


HARDENED = ContainerSecurity()


@dataclass(frozen=True)
class ContainerPlan:
    name: str
    image: str
    entrypoint: tuple[str, ...] | None
    command: tuple[str, ...]
    env: Mapping[str, str]
    ports: Mapping[int, tuple[str, int]]  # container port -> (host ip, host port)
    mounts: tuple[Mount, ...]
    ipc_mode: str | None
    shm_size: str | None
    network_mode: str | None
    gpu: GpuRequest | None
    labels: Mapping[str, str]
    security: ContainerSecurity = HARDENED


# What a process runtime can start (``core.engines.commands.process_command``): llama.cpp
# on every such node (its launcher is part of the agent), vLLM only on a node whose agent
# has a Python with vLLM (HETEROFLOW_AGENT_VLLM_PYTHON) and so reports it.
PROCESS_ENGINES = frozenset({"llamacpp", "vllm"})
PROCESS_ALWAYS = frozenset({"llamacpp"})


def needs_container(command: Sequence[str], engine: str) -> bool:
    """Whether a task can only run in a container: a custom command (a user's program)
    or an engine no process runtime has a launcher for."""
    return bool(command) or engine not in PROCESS_ENGINES


def process_runs(engine: str, reported: Collection[str]) -> bool:
    """Whether a process-runtime node that reports the engines ``reported`` starts
    ``engine`` ("" = its chain picks one later: not decided here)."""
    if not engine or engine in PROCESS_ALWAYS:
        return True
    return engine in PROCESS_ENGINES and engine in reported


def gpu_request(vendor: str, gpu_ids: Sequence[int]) -> GpuRequest | None:
    if not gpu_ids:
        return None
    ids = tuple(str(i) for i in gpu_ids)
    csv = ",".join(ids)
    if vendor == "nvidia":
        return GpuRequest(vendor, device_ids=ids)
    if vendor in ("amd", "hygon"):
        return GpuRequest(
            vendor,
            devices=("/dev/kfd", "/dev/dri"),
            group_add=("video", "render"),
            env={"HIP_VISIBLE_DEVICES": csv},
        )
    if vendor == "ascend":
        cards = tuple(f"/dev/davinci{i}" for i in ids)
        return GpuRequest(
            vendor,
            devices=(*cards, "/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"),
            env={"ASCEND_VISIBLE_DEVICES": csv},
        )
    if vendor == "musa":
        return GpuRequest(vendor, env={"MTHREADS_VISIBLE_DEVICES": csv})
    raise ValueError(f"no GPU runtime arguments known for vendor {vendor!r}")


def container_env(
    user_env: Sequence[str],
    *,
    task_id: str,
    group_id: str,
    task_name: str,
    engine: str,
    engine_env: Mapping[str, str],
    gpu: GpuRequest | None,
    engine_defaults: Mapping[str, str] | None = None,
    gang: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """C3: bare names dropped, agent-owned names dropped, vLLM dev mode for vLLM only; and
    never a denied name (the server refuses them at create; this is the node's own line
    for anything that got past it, e.g. a row written before the rule existed). The
    recipe's ``engine_defaults`` come first, so the task's variables change them;
    ``gang`` (``core.gang.gang_env``: a pipeline stage's rank, world size and
    rendezvous, G1) last, as the agent's own."""
    env: dict[str, str] = dict(engine_defaults or {})
    for item in user_env:
        if "=" not in item:
            continue
        name, value = item.split("=", 1)
        if ENV_NAME.match(name) and name not in AGENT_OWNED_ENV and not env_denied(name):
            env[name] = value
    for name, value in engine_env.items():
        if name == "VLLM_SERVER_DEV_MODE" and engine not in VLLM_FAMILY:
            continue
        env[name] = value
    if gpu is not None:
        env.update(gpu.env)
    env["HETEROFLOW_TASK_ID"] = task_id
    env["HETEROFLOW_GROUP_ID"] = group_id
    env["HETEROFLOW_TASK_NAME"] = task_name
    env.update(gang or {})
    return env


def model_mount(model_path: str, engine: str) -> tuple[Mount | None, str]:
    """(mount, the path the engine is given). TensorRT-LLM's engine dir is in its image."""
    if not model_path or engine in MODEL_IN_IMAGE:
        return None, model_path
    if os.path.isabs(model_path):
        norm = os.path.normpath(model_path)
        return Mount(norm, norm), norm
    name = model_path.strip("/")
    path = f"{DATA_MODELS}/{name}"
    return Mount(path, path), path


def shared_memory(
    parallelism: str, gpus: int, engine: str = ""
) -> tuple[str | None, str | None, str | None]:
    """(ipc_mode, shm_size, network_mode) — C5, confined.

    Docker's default 64 MB /dev/shm deadlocks multi-process GPU executors (seen on A10
    x2 with TP=2): a multi-GPU container gets a 16 GB /dev/shm in its OWN IPC namespace
    — every process of the engine is in the one container, so that is all NCCL needs,
    and the host's IPC namespace (other tenants' shared memory) stays out of reach. The
    spec's ``--ipc=host`` is deliberately not used. A vLLM-family engine gets it with one
    card or none too: its engine core talks to its worker process through a shared-memory
    ring of 160 MiB and refuses to start in 64 MB ("Insufficient space in /dev/shm",
    found running vLLM's CPU build in a container, tests/docker/test_vllm_docker.py); the
    size is a tmpfs limit, not memory taken. Pipeline stages need the host network for
    their rendezvous across nodes; only operators may create them.
    """
    if parallelism == "pipeline":
        return None, SHM_SIZE, "host"
    if gpus > 1 or engine in VLLM_FAMILY:
        return None, SHM_SIZE, None
    return None, None, None
