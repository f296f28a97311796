"""CPU-memory KV-cache offload for vLLM (FEATURES C12): the flag form per vLLM version.

The table was lost with the spec (R); it is rebuilt here from vLLM's history:

======================  ==============================================================
vLLM version            flags for ``kv_offload_gb = G`` (total GiB over the TP ranks)
======================  ==============================================================
< 0.8.0                 ``--swap-space G/TP`` -- V0 engine's CPU KV space, *per GPU*
0.8.0 ... 0.11.0        refused (CommandError): nothing offloads KV with a GiB budget
0.11.1 pre-releases     refused: the flags below landed during that release cycle
>= 0.11.1               ``--kv-offloading-size G --kv-offloading-backend native``
======================  ==============================================================

Why these rows (sources read through the search tool):

* ``--swap-space`` is "CPU swap space size (GiB) per GPU" (vLLM engine args, e.g.
  docs.vllm.ai v0.6.3.post1 / v0.8.x ``engine_args``): the V0 scheduler swaps preempted
  sequences' KV blocks into it. vLLM 0.8.0 made the V1 engine the default, and V1 always
  preempts by recomputation (vllm-project/vllm#18115, maintainer comment), so from 0.8.0
  the flag is still accepted but silently ignored -- the spec's "参数被默认引擎静默忽略".
* ``--cpu-offload-gb`` is *not* a KV offload: it moves model weights to CPU ("virtually
  increases GPU memory"; LMCache#1372, vllm#23087), so it is never emitted for C12.
* 0.10.x/0.11.0 could offload KV only through ``--kv-transfer-config`` with the
  OffloadingConnector (vllm#22595) or LMCache; the connector then took
  ``num_cpu_blocks`` (blocks, per worker), not GiB -- ``cpu_bytes_to_use`` only arrived with
  vllm#24498 -- and LMCache is sized by environment variables, so a GiB budget cannot be
  honoured without model geometry: refused rather than approximated.
* ``--kv-offloading-size`` / ``--kv-offloading-backend`` were proposed in RFC vllm#26858
  (2025-10-15: "When TP > 1, this number should be the total size summed across all the TP
  ranks") and live in ``CacheConfig`` / ``EngineArgs.add_cli_args`` of vllm/engine/arg_utils.py.
  Until vllm#32421 (2026-01) the backend defaulted to None and had to be given together with
  the size, so we always pass ``native`` explicitly. The first release carrying them is
  taken as 0.11.1, the release right after the spec's refused range ends.

Versions are the image's vLLM version as probed by the agent ("0.11.2", "v0.6.3.post1",
"0.10.2+cu128", "0.11.1rc2"); anything else is refused as unparsable.
"""

from __future__ import annotations

import re

from heteroflow.core.engines.errors import CommandError

MIN_GB, MAX_GB = 1, 4096
# (major, minor, patch, final) -- final is 0 for rc/dev builds, which precede the release.
_V1_DEFAULT = (0, 8, 0, 0)
_NATIVE_FLAGS = (0, 11, 1, 1)

_VERSION = re.compile(
    r"v?(\d+)\.(\d+)(?:\.(\d+))?"
    r"(?P<pre>(?:a|b|rc)\d+)?(?:\.post\d+)?(?P<dev>\.dev\d+)?(?:\+[0-9A-Za-z.]+)?"
)


def parse_version(raw: str) -> tuple[int, int, int, int]:
    """Sort key of a vLLM/PEP 440-style version; CommandError when it is not one."""
    match = _VERSION.fullmatch(raw.strip())
    if match is None:
        raise CommandError(f"cannot read engine version {raw!r} (expected e.g. 0.11.2)")
    major, minor, patch = (int(part or 0) for part in match.group(1, 2, 3))
    final = 0 if match.group("pre") or match.group("dev") else 1
    return major, minor, patch, final


def _gib(value: float) -> str:
    # Round down to MiB precision so the per-GPU parts never add up to more than asked.
    mib = int(value * 1024)
    return f"{mib / 1024:.4f}".rstrip("0").rstrip(".")


def kv_offload_args(
    vllm_version: str, gb: int, *, tensor_parallel_size: int = 1
) -> tuple[str, ...]:
    """vLLM flags offloading ``gb`` GiB of KV cache to CPU memory, or CommandError.

    ``gb`` is the instance's total over its TP ranks (C12); ``tensor_parallel_size`` only
    matters for the per-GPU ``--swap-space`` of pre-0.8 images.
    """
    if not MIN_GB <= gb <= MAX_GB:
        raise CommandError(f"kv_offload_gb must be {MIN_GB}-{MAX_GB} GiB, got {gb}")
    if tensor_parallel_size < 1:
        raise CommandError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    version = parse_version(vllm_version)
    if version < _V1_DEFAULT:
        return ("--swap-space", _gib(gb / tensor_parallel_size))
    if version < _NATIVE_FLAGS:
        raise CommandError(
            f"vLLM {vllm_version} cannot offload KV cache to CPU by size: 0.8.0-0.11.0 "
            "(and 0.11.1 pre-releases) silently ignore the old --swap-space and lack "
            "--kv-offloading-size; use an image with vLLM >= 0.11.1 or turn kv_offload_gb off"
        )
    return ("--kv-offloading-size", str(gb), "--kv-offloading-backend", "native")
