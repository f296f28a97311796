"""``heteroflow agent``: the node agent's process root.

It talks to the server over HTTP only: this module and what it imports never load the
server, the database, the services, the API, SQLAlchemy or FastAPI (`.importlinter`,
tests/integration/test_process_roots.py).
"""

from __future__ import annotations

import argparse
import asyncio
import socket

from heteroflow.agent.client import tls_context
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.factory import RuntimeUnavailable, make_launcher
from heteroflow.core.clock import SystemClock
from heteroflow.serving import install_stop_signals
from heteroflow.settings import AgentSettings


def run(a: argparse.Namespace) -> int:
    settings = AgentSettings(**({"runtime": a.runtime} if a.runtime else {}))
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    asyncio.run(_run_agent(settings))
    return 0


async def _run_agent(settings: AgentSettings) -> None:
    try:
        tls_context(settings.ca_file)  # issue 18: an unreadable CA bundle stops the start
    except ValueError as exc:
        raise SystemExit(f"heteroflow agent: {exc}") from exc
    config = NodeConfig.load(settings.config_file)
    name = settings.node_name or socket.gethostname()
    try:
        launcher = make_launcher(settings, config, name)
    except RuntimeUnavailable as exc:
        raise SystemExit(str(exc)) from exc
    agent = Agent(settings, config, launcher, SystemClock())
    stop = asyncio.Event()
    install_stop_signals(stop)
    print(
        f"HeteroFlow agent {agent.name} ({settings.runtime} runtime) -> {settings.server_url}",
        flush=True,
    )
    await agent.run(stop)
