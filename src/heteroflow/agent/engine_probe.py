"""Which engines this node can run (FEATURES C9) and the agent's KV-offload red lines (C12).

Owns:

* ``ImageStore``: the three questions the probe asks a container runtime (local refs,
  image labels, a pip distribution's version inside an image); ``DockerImageStore`` answers
  them through the docker SDK.
* ``probe_engines``: an engine is reported available when its operator-configured image
  is present locally under EXACTLY that reference (``name:tag``; a bare name means
  ``:latest``; ``name@digest`` compared exactly, a tag beside a digest is ignored as Docker
  ignores it; ``docker.io/`` and ``docker.io/library/`` are Docker's own spellings of the
  short name, not other registries), or -- for process-runtime engines -- when its pip
  distribution is installed (vllm, sglang, llamacpp via xllamacpp; on MUSA the pip ``vllm``
  is the vllm-musa build, reported as vllm-mtt). An image found under another registry
  prefix (same repository path and tag) is NOT available: a warning tells the operator to
  ``docker tag`` it (the 2026-09-11 incident: suffix matches pulled from the internet at
  run time). When both an image and pip are present, the image wins. GPU gates: vLLM needs
  an NVIDIA card of CC >= 7.5 or an AMD/Hygon card, SGLang an NVIDIA card of CC > 7.5 or
  an AMD card, vllm-mtt a MUSA card, MindIE an Ascend card; llama.cpp always (CPU);
  TensorRT-LLM is never reported (explicit-only, H3).
* ``ProbeSchedule``: re-probe at start and every 20 heartbeats.
* ``engine_version`` (for C12's flag form) and ``kv_offload_check`` (host-memory 70% lines).
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from heteroflow.agent.inventory import GpuCard
from heteroflow.core.engines.registry import ENGINES
from heteroflow.core.engines.selection import parse_cc

logger = logging.getLogger(__name__)

#: Engine -> the pip distribution that provides it in the process runtime.
PIP_DISTRIBUTIONS: Mapping[str, str] = {
    "vllm": "vllm", "vllm-mtt": "vllm", "sglang": "sglang", "llamacpp": "xllamacpp",
}
#: Image label an operator may set to state the vLLM version without a container run.
VERSION_LABEL = "heteroflow.vllm.version"
KV_OFFLOAD_RED_LINE_PERCENT = 70
_DIST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class ImageStore(Protocol):
    """What the probe needs from a container runtime's local image store."""

    def local_tags(self) -> set[str]:
        """Every local ``repo:tag`` and ``repo@digest`` reference."""
        ...

    def image_labels(self, ref: str) -> dict[str, str]:
        """The labels of local image ``ref`` ({} when absent)."""
        ...

    def distribution_version(self, ref: str, dist: str) -> str | None:
        """The version of pip distribution ``dist`` inside image ``ref``, None if unknown."""
        ...


class DockerImageStore:
    """``ImageStore`` over a ``docker.DockerClient`` (the SDK is not a dependency here)."""

    _SCRIPT = "import sys, importlib.metadata as m; print(m.version(sys.argv[1]))"

    def __init__(self, client: Any) -> None:
        self._client = client

    def local_tags(self) -> set[str]:
        refs: set[str] = set()
        for image in self._client.images.list():
            refs.update(image.tags or ())
            refs.update(image.attrs.get("RepoDigests") or ())
        return refs

    def image_labels(self, ref: str) -> dict[str, str]:
        try:
            labels = self._client.images.get(ref).labels
        except Exception as exc:  # docker.errors.ImageNotFound / APIError
            logger.debug("image labels of %s unreadable: %s", ref, exc)
            return {}
        return {str(k): str(v) for k, v in (labels or {}).items()}

    def distribution_version(self, ref: str, dist: str) -> str | None:
        if not _DIST_NAME.match(dist):
            raise ValueError(f"not a distribution name: {dist!r}")
        try:
            out = self._client.containers.run(
                ref, [self._SCRIPT, dist], entrypoint=["python3", "-c"], remove=True,
                network_disabled=True, stdout=True, stderr=False,
            )
        except Exception as exc:  # ContainerError (not installed), ImageNotFound, APIError
            logger.debug("no %s version in %s: %s", dist, ref, exc)
            return None
        lines = out.decode("utf-8", "replace").split() if isinstance(out, bytes) else []
        return lines[-1] if lines else None


def pip_installed(dist: str) -> bool:
    """Default ``pip_check``: whether ``dist`` is installed in the agent's environment."""
    try:
        importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def default_templates(configured: Mapping[str, str] | None = None) -> dict[str, str]:
    """Engine -> image ref to probe: the operator's ``configured`` refs over the registry's
    default_image for every engine the operator did not configure (TensorRT-LLM: none)."""
    refs = {n: s.default_image for n, s in ENGINES.items() if not s.explicit_only}
    refs.update({k: v for k, v in (configured or {}).items() if k in refs})
    return refs


@dataclass(frozen=True)
class ProbeResult:
    """``available``: engine -> image ref ("" = pip); ``warnings``: texts for the operator."""

    available: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _split_registry(repo: str) -> tuple[str, str]:
    head, sep, rest = repo.partition("/")
    if sep and ("." in head or ":" in head or head == "localhost"):
        if head in ("docker.io", "index.docker.io"):
            return "", rest.removeprefix("library/")
        return head, rest
    return "", repo


def normalize_ref(ref: str) -> str:
    """The reference Docker lists for ``ref``: ``:latest`` added, docker.io spelled short."""
    name, at, digest = ref.strip().partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    repo, tag = (name[:colon], name[colon + 1:]) if colon > slash else (name, "latest")
    registry, path = _split_registry(repo)
    repo = f"{registry}/{path}" if registry else path
    return f"{repo}@{digest}" if at else f"{repo}:{tag}"


def _path_and_tag(ref: str) -> tuple[str, str] | None:
    if "@" in ref:
        return None
    repo, _, tag = ref.rpartition(":")
    return _split_registry(repo)[1], tag


def _other_prefix_copies(wanted: str, local: set[str]) -> list[str]:
    key = _path_and_tag(wanted)
    if key is None:
        return []
    path, tag = key
    found = []
    for ref in sorted(local):
        other = _path_and_tag(ref)
        if other is None or ref == wanted or other[1] != tag:
            continue
        if other[0] == path or other[0].endswith("/" + path) or path.endswith("/" + other[0]):
            found.append(ref)
    return found


def _gpu_gate(engine: str, gpus: Sequence[GpuCard]) -> bool:
    vendors = {card.vendor for card in gpus}
    ccs = [cc for card in gpus if card.vendor == "nvidia" and card.compute_capability
           for cc in [parse_cc(card.compute_capability)] if cc is not None]
    best = max(ccs) if ccs else None
    if engine == "vllm":
        return bool(vendors & {"amd", "hygon"}) or (best is not None and best >= (7, 5))
    if engine == "sglang":
        return "amd" in vendors or (best is not None and best > (7, 5))
    if engine == "vllm-mtt":
        return "musa" in vendors
    if engine == "mindie":
        return "ascend" in vendors
    return engine == "llamacpp"


def probe_engines(
    store: ImageStore | None,
    templates: Mapping[str, str],
    gpus: Sequence[GpuCard],
    pip_check: Callable[[str], bool],
) -> ProbeResult:
    """Probe every known engine (see the module docstring for the rules)."""
    result = ProbeResult()
    local = {normalize_ref(ref) for ref in store.local_tags()} if store is not None else set()
    for engine, spec in ENGINES.items():
        if spec.explicit_only:
            continue
        image = ""
        template = templates.get(engine, "")
        if store is not None and template:
            wanted = normalize_ref(template)
            if wanted in local:
                image = template
            else:
                for found in _other_prefix_copies(wanted, local):
                    result.warnings.append(
                        f"engine {engine}: image {template} is not present locally, but "
                        f"{found} is (same repository and tag under another registry "
                        f"prefix); it is not used as is -- run `docker tag {found} "
                        f"{template}` to make {engine} available"
                    )
        dist = PIP_DISTRIBUTIONS.get(engine)
        via_pip = not image and dist is not None and pip_check(dist)
        if not (image or via_pip):
            continue
        if not _gpu_gate(engine, gpus):
            logger.debug("engine %s present (%s) but no suitable card on this node",
                        engine, image or f"pip {dist}")
            continue
        result.available[engine] = image
    for text in result.warnings:
        logger.warning("%s", text)
    return result


def engine_version(store: ImageStore, ref: str, dist: str = "vllm") -> str | None:
    """The version of ``dist`` in image ``ref``: label ``VERSION_LABEL`` first, else probed."""
    labelled = store.image_labels(ref).get(VERSION_LABEL, "").strip()
    return labelled or store.distribution_version(ref, dist)


class ProbeSchedule:
    """When to probe: heartbeats count from 0 (the start); probe on multiples of ``every``."""

    def __init__(self, every: int = 20) -> None:
        if every < 1:
            raise ValueError(f"probe interval must be >= 1 heartbeat, got {every}")
        self.every = every

    def due(self, heartbeat_no: int) -> bool:
        return heartbeat_no % self.every == 0


def kv_offload_check(
    requested_gb: int, node_declared_total_gb: int, mem_total_mb: int, mem_available_mb: int
) -> str | None:
    """Why a ``requested_gb`` GiB KV offload must not start here, or None (0 = off: None).

    ``node_declared_total_gb``: the GiB already declared by the OTHER offloading instances
    on this node (this one is added here). Lines: that sum plus this one <= 70% of MemTotal,
    and this one <= 70% of MemAvailable. Memory figures are MiB as in the heartbeat.
    """
    if requested_gb == 0:
        return None
    if requested_gb < 0 or node_declared_total_gb < 0:
        return (
            f"kv_offload_gb must be positive (requested {requested_gb} GiB, "
            f"declared on node {node_declared_total_gb} GiB)"
        )
    pct = KV_OFFLOAD_RED_LINE_PERCENT
    total = node_declared_total_gb + requested_gb
    if total * 1024 * 100 > mem_total_mb * pct:
        return (
            f"kv_offload_gb {requested_gb} GiB refused: offload declared on this node would "
            f"total {total} GiB ({node_declared_total_gb} GiB already + {requested_gb} GiB), "
            f"over {pct}% of MemTotal {mem_total_mb / 1024:.1f} GiB "
            f"(limit {mem_total_mb * pct / 100 / 1024:.1f} GiB)"
        )
    if requested_gb * 1024 * 100 > mem_available_mb * pct:
        return (
            f"kv_offload_gb {requested_gb} GiB refused: over {pct}% of MemAvailable "
            f"{mem_available_mb / 1024:.1f} GiB (limit "
            f"{mem_available_mb * pct / 100 / 1024:.1f} GiB)"
        )
    return None
