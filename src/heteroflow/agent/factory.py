"""Builds the agent's launcher for the configured runtime (docker | process)."""

from __future__ import annotations

from collections.abc import Sequence

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.inventory import GpuCard
from heteroflow.agent.launch import Launcher, ProcessLauncher
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.settings import AgentSettings


class RuntimeUnavailable(Exception):
    pass


def make_launcher(settings: AgentSettings, config: NodeConfig, node_name: str) -> Launcher:
    logs = settings.work_dir / "logs"
    if settings.runtime == "process":
        return ProcessLauncher(
            ProcessRuntime(settings.work_dir),
            config,
            cpu_threads=settings.cpu_threads,
            log_dir=logs,
            address=settings.address,
            vllm_python=settings.vllm_python,
        )
    return _docker(settings, config, node_name)


def _docker(settings: AgentSettings, config: NodeConfig, node_name: str) -> Launcher:
    import docker
    from docker.errors import DockerException

    from heteroflow.agent.container_launch import DockerLauncher
    from heteroflow.agent.engine_probe import (
        DockerImageStore,
        default_templates,
        engine_version,
        pip_installed,
        probe_engines,
    )
    from heteroflow.agent.runtime.docker import DockerRuntime

    try:
        client = (
            docker.DockerClient(base_url=settings.docker_host)
            if settings.docker_host
            else docker.from_env()
        )
        client.ping()
    except DockerException as exc:
        raise RuntimeUnavailable(
            f"cannot reach the Docker Engine ({settings.docker_host or 'DOCKER_HOST/default'}):"
            f" {exc}; start dockerd or run the agent with --runtime process"
        ) from exc
    runtime = DockerRuntime(client, node_id=node_name, agent_id=node_name)
    store = DockerImageStore(client)
    templates = default_templates(config.engine_images)

    def prober(cards: Sequence[GpuCard]) -> dict[str, str]:
        result = probe_engines(store, templates, cards, pip_installed)
        return dict(result.available)

    return DockerLauncher(
        runtime,
        config,
        address=settings.address,
        work_dir=settings.work_dir,
        prober=prober,
        version_of=lambda image: engine_version(store, image),
        pull_timeout_s=settings.image_pull_timeout_s,
    )
