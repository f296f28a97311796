"""The Docker tier: tests against a real, private Docker Engine.

``docker_client`` runs ``scripts/test-dockerd`` (which starts a private dockerd with its
own socket, data dir and bridge under ``$HETEROFLOW_TEST_DOCKERD_DIR``, default
``/tmp/heteroflow-dockerd``, or finds it running) and connects to it. The daemon is left
running for the next session (``scripts/test-dockerd stop`` removes it). When it cannot be
started (not root, no Debian packages, ...) every test here is skipped with the reason,
unless HETEROFLOW_REQUIRE_DOCKER=1, which turns that into a failure.

Each test gets a ``DockerRuntime`` with an agent id of its own, so tests never see each
other's containers; whatever carries that id is removed after the test. Images are built
locally once and reused while their content hash matches (``heteroflow.testing.engine_image``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from heteroflow.core.containers import ContainerPlan, GpuRequest, Mount

ROOT = Path(__file__).resolve().parents[2]
DOCKERD_DIR = os.environ.get("HETEROFLOW_TEST_DOCKERD_DIR", "/tmp/heteroflow-dockerd")


def _unavailable(reason: str) -> None:
    if os.environ.get("HETEROFLOW_REQUIRE_DOCKER") == "1":
        pytest.fail(f"Docker required (HETEROFLOW_REQUIRE_DOCKER=1) but {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    try:
        import docker
    except ImportError:
        _unavailable("the docker SDK is not installed (pip install docker)")
    try:
        proc = subprocess.run(
            [str(ROOT / "scripts" / "test-dockerd"), DOCKERD_DIR],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        _unavailable(f"scripts/test-dockerd could not run: {exc}")
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("DOCKER_HOST="):
        _unavailable(f"the private dockerd did not start: {proc.stderr.strip()[-800:]}")
    client = docker.DockerClient(base_url=lines[-1].split("=", 1)[1], timeout=120)
    try:
        client.ping()
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def busybox_image(docker_client: Any) -> str:
    from heteroflow.testing.engine_image import ensure_busybox_image

    return ensure_busybox_image(docker_client)


@pytest.fixture(scope="session")
def engine_image(docker_client: Any) -> str:
    from heteroflow.testing.engine_image import ensure_engine_image

    return ensure_engine_image(docker_client)


@pytest.fixture
def runtime(docker_client: Any) -> Iterator[Any]:
    from heteroflow.agent.runtime.docker import DockerRuntime

    rt = DockerRuntime(docker_client, node_id="node-test", agent_id=f"agent-{secrets.token_hex(4)}")
    try:
        yield rt
    finally:
        for task_id in rt.managed():
            rt.remove(task_id)


def new_task_id() -> str:
    return f"task-{secrets.token_hex(6)}"


def make_plan(
    image: str,
    command: tuple[str, ...],
    *,
    name: str | None = None,
    entrypoint: tuple[str, ...] | None = None,
    env: Mapping[str, str] | None = None,
    ports: Mapping[int, tuple[str, int]] | None = None,
    mounts: tuple[Mount, ...] = (),
    ipc_mode: str | None = None,
    shm_size: str | None = None,
    network_mode: str | None = None,
    gpu: GpuRequest | None = None,
    labels: Mapping[str, str] | None = None,
) -> ContainerPlan:
    return ContainerPlan(
        name=name or new_task_id(),
        image=image,
        entrypoint=entrypoint,
        command=command,
        env=dict(env or {}),
        ports=dict(ports or {}),
        mounts=mounts,
        ipc_mode=ipc_mode,
        shm_size=shm_size,
        network_mode=network_mode,
        gpu=gpu,
        labels=dict(labels or {}),
    )


def wait_until(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    """On failure, attach the server/agent logs of an end-to-end stack (``dstack``)."""
    outcome = yield
    rep = outcome.get_result()
    st = getattr(item, "funcargs", {}).get("dstack")
    if rep.failed and st is not None:
        rep.sections.append(("process logs", st.logs()))
