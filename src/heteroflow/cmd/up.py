"""``heteroflow up``: server + scheduler + a local agent + gateway, and a demo service.

Everything runs in one process on the embedded SQLite default; engines are child
processes of the in-process agent (process runtime). Ctrl-C stops the engines first,
then the server: no orphan engine survives.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.factory import RuntimeUnavailable, make_launcher
from heteroflow.db.tables import InferenceEndpoint, Node, TaskGroup, User
from heteroflow.models.demo import GEMMA_CHAT_TEMPLATE, DemoModelUnavailable, ensure_demo_model
from heteroflow.schemas.task_groups import TaskGroupCreate
from heteroflow.server import ServerApp
from heteroflow.services import endpoints, task_groups
from heteroflow.services.auth import Principal
from heteroflow.serving import bind, install_stop_signals
from heteroflow.settings import AgentSettings, ServerSettings

log = logging.getLogger(__name__)
DEMO_NAME = "demo"
DEMO_IMAGE = "ghcr.io/ggml-org/llama.cpp:server"


@dataclass(frozen=True, slots=True)
class UpOptions:
    data_dir: Path
    models_dir: Path
    host: str
    port: int
    demo: str  # auto | gemma | tiny | none
    agent_config: Path | None
    threads: int
    runtime: str = "process"


def _pick_model(opts: UpOptions) -> tuple[Path, str] | None:
    if opts.demo == "none":
        return None
    kinds = ["gemma", "tiny"] if opts.demo == "auto" else [opts.demo]
    for kind in kinds:
        try:
            return ensure_demo_model(opts.models_dir, kind), kind
        except DemoModelUnavailable as exc:
            if opts.demo != "auto":
                raise SystemExit(str(exc)) from exc
            print(f"note: {exc}; serving the generated tiny model instead", file=sys.stderr)
    return None


def _admin(app: ServerApp) -> Principal:
    with app.db.session() as s:
        u = s.scalar(select(User).where(User.username == "admin"))
        assert u is not None
        return Principal(u.id, u.username, u.tenant_id, u.role)


def _deploy_demo(app: ServerApp, model: Path, kind: str) -> tuple[str, str, str]:
    """(group id, model name, api key): reuse a running demo (rotating its key), else create."""
    who = _admin(app)
    model_name = "gemma-3-270m" if kind == "gemma" else "heteroflow-tiny"
    template = ["--chat-template", GEMMA_CHAT_TEMPLATE] if kind == "gemma" else []
    with app.db.session() as s:
        old = s.scalar(
            select(TaskGroup).where(TaskGroup.name == DEMO_NAME, TaskGroup.deleted_at.is_(None))
        )
        if old is not None:
            task_groups.delete_group(s, who, app.clock, old.id)
    with app.db.session() as s:
        # a deleted demo's endpoint is gone; free the name of any stale one
        stale = s.scalar(select(InferenceEndpoint).where(InferenceEndpoint.name == DEMO_NAME))
        if stale is not None:
            endpoints.delete_endpoint(s, who, stale.id)
        created = task_groups.create_group(
            s,
            who,
            app.clock,
            TaskGroupCreate.model_validate(
                {
                    "name": DEMO_NAME,
                    "model_name": model_name,
                    "enable_api": True,
                    "health_check": {"start_period_seconds": 120, "interval_seconds": 2},
                    "task": {
                        "image": DEMO_IMAGE,
                        "engine": "llamacpp",
                        "gpu_required": 0,
                        "model_path": str(model),
                        "memory_mb": 1024,
                        "engine_args": ["-np", "2", "-c", "4096", "--embeddings", *template],
                    },
                }
            ),
            offline_after_s=app.settings.node_offline_after_s,
        )
    assert created.api_key is not None
    return created.id, model_name, created.api_key


async def _wait_registered(
    app: ServerApp, node_name: str, stop: asyncio.Event, timeout_s: float = 60.0
) -> bool:
    """The local agent's first heartbeat: until it reports its volume rules, no node
    allows the demo's absolute model path and the create would be refused."""
    started = app.clock.now()
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not stop.is_set() and asyncio.get_running_loop().time() < deadline:
        with app.db.session() as s:
            seen = s.scalar(select(Node.last_heartbeat_at).where(Node.name == node_name))
        if seen is not None and seen >= started:
            return True
        await asyncio.sleep(0.2)
    if not stop.is_set():
        print(f"the local agent did not register within {timeout_s:.0f} s; no demo deployed")
    return False


async def _wait_running(app: ServerApp, group_id: str, stop: asyncio.Event) -> str:
    last = ""
    while not stop.is_set():
        with app.db.session() as s:
            g = s.get(TaskGroup, group_id)
            status = g.status if g else "missing"
        if status != last:
            print(f"  demo service: {status}", flush=True)
            last = status
        if status in ("running", "failed", "stopped", "missing"):
            return status
        await asyncio.sleep(0.3)
    return last


def _instructions(base: str, model_name: str, key: str) -> str:
    return textwrap.dedent(
        f"""
        HeteroFlow is up: API and OpenAI-compatible gateway on {base}
          API key (shown once): {key}

          curl {base}/v1/chat/completions \\
            -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
            -d '{{"model": "{model_name}", "max_tokens": 32,
                 "messages": [{{"role": "user", "content": "Hello"}}]}}'

          {sys.executable} -c 'from openai import OpenAI
        c = OpenAI(base_url="{base}/v1", api_key="{key}")
        print(c.chat.completions.create(model="{model_name}", max_tokens=32,
              messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)'

        Press Ctrl-C to stop (engines are stopped with it).
        """
    )


async def run_up(opts: UpOptions) -> int:
    opts.models_dir.mkdir(parents=True, exist_ok=True)
    picked = _pick_model(opts)
    settings = ServerSettings(data_dir=opts.data_dir, host=opts.host, port=opts.port)
    app = ServerApp(settings)
    if app.bootstrap.admin_password_generated:
        print(f"admin password (shown once): {app.bootstrap.admin_password_generated}")
    sock = bind(opts.host, opts.port)
    port = sock.getsockname()[1]
    base = f"http://{opts.host}:{port}"
    node_cfg = NodeConfig.load(opts.agent_config)
    node_cfg = dataclasses.replace(
        node_cfg,
        allowed_volume_prefixes=(*node_cfg.allowed_volume_prefixes, str(opts.models_dir)),
        model_scan_dirs=(*(node_cfg.model_scan_dirs or ()), str(opts.models_dir)),
    )
    agent_settings = AgentSettings(
        server_url=base,
        node_token=app.node_token,
        node_name=os.uname().nodename,
        work_dir=opts.data_dir / "agent",
        heartbeat_interval_s=2.0,
        cpu_threads=opts.threads,
        runtime="docker" if opts.runtime == "docker" else "process",
        stop_engines_on_exit=True,  # Ctrl-C leaves no engine behind
    )
    try:
        launcher = make_launcher(agent_settings, node_cfg, agent_settings.node_name)
    except RuntimeUnavailable as exc:
        raise SystemExit(str(exc)) from exc
    print(f"local agent: {opts.runtime} runtime")
    agent = Agent(agent_settings, node_cfg, launcher, app.clock)
    stop = asyncio.Event()
    install_stop_signals(stop)
    server = asyncio.create_task(app.serve(stop, sock, extra=[agent.run]))
    print(f"HeteroFlow server on {base} (data: {opts.data_dir}, models: {opts.models_dir})")
    if picked is not None and await _wait_registered(app, agent_settings.node_name, stop):
        group_id, model_name, key = await asyncio.to_thread(
            _deploy_demo, app, picked[0], picked[1]
        )
        print(f"deploying {model_name} from {picked[0]} ...", flush=True)
        status = await _wait_running(app, group_id, stop)
        if status == "running":
            print(_instructions(base, model_name, key), flush=True)
        elif not stop.is_set():
            print(f"the demo service ended {status}; see `heteroflow services show {group_id}`")
    await server
    return 0
