"""The multi-machine install (issue 18, deploy/): the Compose files and the systemd units
name only real settings, real commands and flags, real services and health checks.

No image can be built or pulled here (no registry, no python base image on the test
Docker Engine), so the files are checked statically against the code that reads them:
the settings classes, the CLI's parser, and `systemd-analyze verify` where it exists.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML: uvicorn[standard] brings it
from pydantic_settings import BaseSettings

from heteroflow.cli import build_parser
from heteroflow.settings import AgentSettings, ServerSettings

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "compose"
SYSTEMD = DEPLOY / "systemd"
VAR = re.compile(r"\bHETEROFLOW_[A-Z0-9_]+\b")
# variables of other programs the files set on purpose: the gateway unit's --server,
# OpenSSL's CA bundle, uvicorn's trusted proxies
OTHER_VARS = {"GATEWAY_SERVER_URL", "SSL_CERT_FILE", "FORWARDED_ALLOW_IPS"}


def setting_names(cls: type[BaseSettings]) -> set[str]:
    prefix = str(cls.model_config.get("env_prefix", ""))
    return {prefix.upper() + name.upper() for name in cls.model_fields}


SERVER_VARS = setting_names(ServerSettings)
AGENT_VARS = setting_names(AgentSettings)


def deploy_files() -> list[Path]:
    return sorted(
        p for p in DEPLOY.rglob("*")
        if p.is_file() and "grafana" not in p.relative_to(DEPLOY).parts
    )


def load_yaml(name: str) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((COMPOSE / name).read_text())
    return data


def env_file(path: Path) -> dict[str, str]:
    """KEY=value lines of an env file, commented-out examples (#KEY=value) too."""
    found: dict[str, str] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^#?([A-Z][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            found[m.group(1)] = m.group(2)
    return found


def test_every_heteroflow_variable_in_deploy_is_a_real_setting() -> None:
    files = deploy_files()
    assert {p.name for p in files} >= {
        "Dockerfile", "compose.yaml", "compose.agent.yaml", "Caddyfile", "env.example",
        "heteroflow-server.service", "heteroflow-gateway.service", "heteroflow-agent.service",
        "server.env", "gateway.env", "agent.env",
    }
    unknown = {
        f"{p.relative_to(ROOT)}: {name}"
        for p in files
        for name in VAR.findall(p.read_text())
        if name not in SERVER_VARS | AGENT_VARS
    }
    assert not unknown, sorted(unknown)


@pytest.mark.parametrize(
    ("name", "allowed"),
    [("server.env", SERVER_VARS), ("gateway.env", SERVER_VARS), ("agent.env", AGENT_VARS)],
)
def test_each_env_example_sets_its_own_process_settings(name: str, allowed: set[str]) -> None:
    keys = set(env_file(SYSTEMD / name))
    assert keys, name
    assert keys - allowed - OTHER_VARS == set()


# ---- Compose ------------------------------------------------------------------------


def argv(service: dict[str, Any]) -> Any:
    """The service's command as `heteroflow` (the image's entrypoint) parses it."""
    return build_parser().parse_args(service["command"])


def test_the_control_plane_has_two_servers_on_postgres_and_two_gateways_on_redis() -> None:
    services = load_yaml("compose.yaml")["services"]
    assert set(services) == {
        "postgres", "redis", "server-1", "server-2", "gateway-1", "gateway-2", "lb",
    }
    urls = set()
    for name in ("server-1", "server-2"):
        s = services[name]
        a = argv(s)
        assert (a.cmd, a.host, a.port) == ("server", "0.0.0.0", 3333)
        env = s["environment"]
        assert set(env) - SERVER_VARS <= OTHER_VARS
        assert "HETEROFLOW_NODE_TOKEN" not in env  # stored, so it can be rotated
        assert env["HETEROFLOW_REDIS_URL"].startswith("redis://redis:")
        urls.add(env["HETEROFLOW_DATABASE_URL"])
        assert "/healthz" in " ".join(s["healthcheck"]["test"])
    (url,) = urls  # one database for both
    assert url.startswith("postgresql://") and "@postgres:5432/" in url
    for name in ("gateway-1", "gateway-2"):
        s = services[name]
        a = argv(s)
        assert a.cmd == "gateway" and a.routes is None and a.port == 3333
        assert a.server == "http://lb:3333"  # the servers, through the balancer
        assert a.token is None  # from the environment, never on the command line
        env = s["environment"]
        assert set(env) <= SERVER_VARS
        assert env["HETEROFLOW_REDIS_URL"].startswith("redis://redis:")
        assert env["HETEROFLOW_GATEWAY_TOKEN"] == services["server-1"]["environment"][
            "HETEROFLOW_GATEWAY_TOKEN"
        ]
        assert "/metrics" in " ".join(s["healthcheck"]["test"])


def test_dependencies_exist_are_healthy_and_migrations_run_once() -> None:
    services = load_yaml("compose.yaml")["services"]
    graph: dict[str, set[str]] = {}
    for name, s in services.items():
        deps = s.get("depends_on", {})
        graph[name] = set(deps)
        for dep, how in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            if how["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
        if name != "lb":
            assert "healthcheck" in s, f"{name} has no healthcheck"
    # server-2 waits for server-1 (which migrates the schema at its start)
    assert services["server-2"]["depends_on"]["server-1"]["condition"] == "service_healthy"
    assert services["server-1"]["depends_on"]["postgres"]["condition"] == "service_healthy"

    def reach(node: str, seen: frozenset[str]) -> None:
        assert node not in seen, f"dependency cycle through {node}"
        for dep in graph[node]:
            reach(dep, seen | {node})

    for name in graph:
        reach(name, frozenset())


def test_the_balancer_fronts_the_services_compose_runs() -> None:
    services = load_yaml("compose.yaml")["services"]
    caddy = (COMPOSE / "Caddyfile").read_text()
    sites = dict(re.findall(r"^:(\d+) \{\n\treverse_proxy ([^{]+)\{", caddy, flags=re.M))
    assert set(sites) == {"3333", "8080"}
    assert sites["3333"].split() == ["server-1:3333", "server-2:3333"]
    assert sites["8080"].split() == ["gateway-1:3333", "gateway-2:3333"]
    assert services["lb"]["ports"] == ["3333:3333", "8080:8080"]
    assert "./Caddyfile:/etc/caddy/Caddyfile:ro" in services["lb"]["volumes"]


def test_compose_secrets_come_from_the_env_example() -> None:
    defined = set(env_file(COMPOSE / "env.example"))
    required = set(re.findall(r"\$\{([A-Z_]+):\?", (COMPOSE / "compose.yaml").read_text()))
    assert required and required <= defined


def test_the_agent_compose_file_runs_a_docker_agent_with_the_nvidia_runtime() -> None:
    (agent,) = load_yaml("compose.agent.yaml")["services"].values()
    a = argv(agent)
    assert (a.cmd, a.runtime) == ("agent", "docker")
    env = agent["environment"]
    assert set(env) <= AGENT_VARS
    assert {"HETEROFLOW_AGENT_SERVER_URL", "HETEROFLOW_AGENT_NODE_TOKEN",
            "HETEROFLOW_AGENT_ADDRESS", "HETEROFLOW_AGENT_CA_FILE"} <= set(env)
    assert agent["network_mode"] == "host"
    devices = agent["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in agent["volumes"]}
    assert mounts["/var/run/docker.sock"] == "/var/run/docker.sock"
    # Docker mounts the agent's work files into engines: the same path on both sides
    work = env["HETEROFLOW_AGENT_WORK_DIR"]
    assert mounts[work] == work
    assert Path(env["HETEROFLOW_AGENT_CONFIG_FILE"]).parent.as_posix() in mounts


def test_the_dockerfile_builds_this_repository() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, flags=re.M)
    assert re.search(r"^RUN pip install \.", text, flags=re.M)
    assert 'ENTRYPOINT ["heteroflow"]' in text
    assert re.search(r"^USER heteroflow$", text, flags=re.M)
    for src in re.findall(r"^COPY (.+) \S+$", text, flags=re.M):
        for path in src.split():
            assert (ROOT / path).exists(), path
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    assert {"*", "!pyproject.toml", "!README.md", "!src/"} <= set(ignore)
    for name in ("compose.yaml", "compose.agent.yaml"):
        for s in load_yaml(name)["services"].values():
            if "build" in s:
                assert (COMPOSE / s["build"]["context"] / s["build"]["dockerfile"]).resolve() \
                    == DEPLOY / "Dockerfile"


# ---- systemd --------------------------------------------------------------------------


def unit(name: str) -> dict[str, list[tuple[str, str]]]:
    sections: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for line in (SYSTEMD / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            current = line.strip("[]")
            sections[current] = []
            continue
        key, _, value = line.partition("=")
        sections[current].append((key, value))
    return sections


def values(section: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in section if k == key]


@pytest.mark.parametrize("role", ["server", "gateway", "agent"])
def test_each_unit_runs_its_real_command_as_a_dedicated_user(role: str) -> None:
    u = unit(f"heteroflow-{role}.service")
    svc = u["Service"]
    assert values(svc, "User") == ["heteroflow"]
    assert values(svc, "Restart") == ["on-failure"]
    assert values(svc, "NoNewPrivileges") == ["yes"]
    assert values(svc, "ProtectSystem") == ["strict"]
    (env_path,) = values(svc, "EnvironmentFile")
    assert env_path == f"/etc/heteroflow/{role}.env"
    env = env_file(SYSTEMD / f"{role}.env")
    (exec_start,) = values(svc, "ExecStart")
    words = shlex.split(exec_start)
    assert words[0] == "/opt/heteroflow/bin/heteroflow"
    expanded = [re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], w) for w in words[1:]]
    a = build_parser().parse_args(expanded)
    assert a.cmd == role
    if role == "gateway":
        assert a.server == env["GATEWAY_SERVER_URL"] and a.token is None
    assert values(u["Install"], "WantedBy") == ["multi-user.target"]


def test_the_agent_keeps_its_docker_socket_and_gpus() -> None:
    svc = dict(unit("heteroflow-agent.service")["Service"])
    assert svc["SupplementaryGroups"] == "docker"
    # each of these would hide /dev/nvidia* or the Docker socket from the agent
    for key in ("PrivateDevices", "ProtectClock", "DeviceAllow", "DevicePolicy",
                "PrivateNetwork", "RestrictAddressFamilies"):
        assert key not in svc, key
    assert svc["KillMode"] == "mixed"  # the agent stops its own engines first
    server = dict(unit("heteroflow-server.service")["Service"])
    assert server["PrivateDevices"] == "yes" and server["CapabilityBoundingSet"] == ""


def test_systemd_analyze_verifies_the_units(tmp_path: Path) -> None:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed")
    heteroflow = Path(sys.executable).parent / "heteroflow"  # an executable that exists
    for src in SYSTEMD.glob("*.service"):
        text = src.read_text().replace("/opt/heteroflow/bin/heteroflow", str(heteroflow))
        (tmp_path / src.name).write_text(text)
    r = subprocess.run(
        [tool, "verify", "--man=no", *sorted(str(p) for p in tmp_path.glob("*.service"))],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert (r.returncode, r.stderr) == (0, "")
