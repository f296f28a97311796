"""``heteroflow up``: server + scheduler + a local agent + gateway, and a demo service.

Everything runs in one process on the embedded SQLite default; engines are child
processes of the in-process agent (process runtime). Ctrl-C stops the engines first,
then the server: no orphan engine survives.

A new user is never left without a way in: every slow step says what it does, the
demo keeps its API key from one ``up`` to the next (``DATA_DIR/demo-api-key``), the
CLI is logged in as ``admin`` (unless it is logged in to another server), and how to
log in, where the admin password is and where the API docs are is printed every time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import logging
import os
import sys
import textwrap
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from sqlalchemy import select

from heteroflow import logs
from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.factory import RuntimeUnavailable, make_launcher
from heteroflow.cmd import instance_lock
from heteroflow.cmd.errors import CliError
from heteroflow.cmd.up_cli import CLI_TOKEN_TTL_S as CLI_TOKEN_TTL_S  # re-exported
from heteroflow.cmd.up_cli import (  # up's CLI side, split off
    cli_command,
    login_cli,
    management_hints,
)
from heteroflow.core.errors import Conflict
from heteroflow.core.ids import new_api_key
from heteroflow.core.ports import ephemeral_overlap, local_ephemeral_range
from heteroflow.core.states import AGENT_OWNED
from heteroflow.db.tables import InferenceEndpoint, Node, Task, TaskGroup, User
from heteroflow.models.demo import DemoModelUnavailable, ensure_demo_model
from heteroflow.private_files import private_file
from heteroflow.schemas.task_groups import TaskGroupCreate
from heteroflow.server import ServerApp
from heteroflow.services.identity.auth import Principal
from heteroflow.services.lifecycle import task_groups
from heteroflow.services.serving import endpoints
from heteroflow.serving import bind, install_stop_signals, settle_heap, share_the_gil
from heteroflow.settings import AgentSettings, ServerSettings

log = logging.getLogger(__name__)
DEMO_NAME = "demo"
DEMO_IMAGE = "ghcr.io/ggml-org/llama.cpp:server"
DEMO_KEY_FILE = "demo-api-key"
# tasks an agent runs an engine for: the one definition (core/states.py)
ENGINE_OWNED = frozenset(st.value for st in AGENT_OWNED)
DONE = frozenset({"running", "failed", "stopped", "missing"})
LOG_FILE = "logs/heteroflow.log"  # under the data directory
# how long up follows the user's own services after a restart before it stops saying
RESTORE_WATCH_S = 180.0


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
    port_range: tuple[int, int] | None = None  # engines' host ports (default: the setting)


def say(line: str) -> None:
    print(line, flush=True)


class Elapsed:
    """Seconds since ``up`` started, as the ``[14s]`` prefix of a progress line."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __str__(self) -> str:
        return f"[{time.monotonic() - self.t0:.0f}s]"


def _pick_model(opts: UpOptions) -> tuple[Path, str] | None:
    if opts.demo == "none":
        return None
    kinds = ["gemma", "tiny"] if opts.demo == "auto" else [opts.demo]
    for kind in kinds:
        try:
            return ensure_demo_model(opts.models_dir, kind, progress=say), kind
        except DemoModelUnavailable as exc:
            if opts.demo != "auto":
                raise SystemExit(str(exc)) from exc
            print(f"note: {exc}; serving the generated tiny model instead", file=sys.stderr)
    return None


# ---- the demo's key: one file, owner-only, reused by every `up` ----


def demo_key(data_dir: Path) -> str:
    """The demo's API key from ``DATA_DIR/demo-api-key`` (0600); made there when missing.

    A key the owner wrote into the file is used as it is, if it is a valid key
    (``endpoints.CHOSEN_KEY``); anything else is replaced by a new key.
    """
    path = data_dir / DEMO_KEY_FILE
    try:
        key = path.read_text().strip()
    except FileNotFoundError:
        key = ""
    if key and endpoints.CHOSEN_KEY.fullmatch(key):
        private_file(path)  # owner-only, even if someone loosened it
        return key
    if key:
        print(f"note: {path} holds no valid API key; writing a new one", file=sys.stderr)
    return _write_demo_key(path, new_api_key())


def _write_demo_key(path: Path, key: str) -> str:
    private_file(path)  # created 0600 before the secret goes in
    path.write_text(key + "\n")
    return key


# ---- the demo service: kept when unchanged, else created with the kept key ----


@dataclass(frozen=True, slots=True)
class Demo:
    group_id: str
    model_name: str
    kept: bool  # the service of an earlier `up`, kept as it was
    # kept with tasks an agent claimed: the new agent adopts them, or gives them back as
    # scheduled (their engines stopped with the last run) and starts them again
    agent_owned: bool


def _admin(app: ServerApp) -> Principal:
    with app.db.session() as s:
        u = s.scalar(select(User).where(User.username == "admin"))
        assert u is not None
        return Principal(u.id, u.username, u.tenant_id, u.role)


def _demo_request(model: Path, kind: str) -> TaskGroupCreate:
    model_name = "gemma-3-270m" if kind == "gemma" else "heteroflow-tiny"
    return TaskGroupCreate.model_validate(
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
                # mean pooling: the Gemma GGUF declares none, and llama.cpp then refuses
                # /v1/embeddings ("Pooling type 'none' is not OAI compatible")
                # no chat template: the Gemma GGUF carries none, and every llama.cpp
                # service gets its family's (core.engines.chat_templates), as this one
                "engine_args": ["-np", "2", "-c", "4096", "--embeddings", "--pooling", "mean"],
            },
        }
    )


def _deploy_demo(app: ServerApp, req: TaskGroupCreate, key: str, *, keep: bool) -> Demo:
    """The demo group with ``key`` as its endpoint's key.

    An earlier ``up``'s demo in the admin's tenant is kept whenever it serves the same
    model with the same engine arguments (its current tasks say so), whatever state its
    tasks are in: the last run's shutdown gave its engines back as ``scheduled``, and the
    new agent starts them again on their placements (issue 26), so the group, its
    endpoint and its key live on. ``keep`` False is the
    caller's word that the kept demo ended (failed) meanwhile: then its ended ranks are
    started afresh at once, as ``services start`` would (the rebuild count starts over).
    A demo its owner stopped stays stopped. Only a demo of another spec is deleted and a
    new group created, whose key is then set to ``key``.
    """
    who = _admin(app)
    with app.db.session() as s:
        olds = s.scalars(
            select(TaskGroup)
            .where(
                TaskGroup.name == DEMO_NAME,
                TaskGroup.tenant_id == who.tenant_id,
                TaskGroup.deleted_at.is_(None),
            )
            .order_by(TaskGroup.created_at.desc())
        ).all()
        for old in olds:
            tasks = list(
                s.scalars(select(Task).where(Task.group_id == old.id, Task.replaced_by == ""))
            )
            same = (
                old.model_name == req.model_name
                and bool(tasks)
                and all(
                    t.model_path == req.task.model_path
                    and list(t.engine_args) == list(req.task.engine_args)
                    for t in tasks
                )
            )
            if same and old.endpoint_id is not None:
                endpoints.set_endpoint_key(s, who, app.clock, old.endpoint_id, key)
                if not keep and old.desired == "running":
                    # Conflict: the recovery loop brought it back meanwhile
                    with contextlib.suppress(Conflict):
                        task_groups.start_group(s, who, app.clock, old.id)
                owned = any(t.status in ENGINE_OWNED for t in tasks)
                return Demo(old.id, old.model_name, kept=True, agent_owned=owned)
            task_groups.delete_group(s, who, app.clock, old.id)
    with app.db.session() as s:
        # a deleted demo's endpoint is gone; free the name of any stale one
        stale = s.scalar(
            select(InferenceEndpoint).where(
                InferenceEndpoint.name == DEMO_NAME, InferenceEndpoint.tenant_id == who.tenant_id
            )
        )
        if stale is not None:
            endpoints.delete_endpoint(s, who, stale.id)
            s.flush()
        created = task_groups.create_group(
            s, who, app.clock, req, offline_after_s=app.settings.node_offline_after_s
        )
        assert created.endpoint is not None
        # a Conflict (the key is another endpoint's: a hand-edited file or database)
        # rolls the whole create back; the caller says so
        endpoints.set_endpoint_key(s, who, app.clock, created.endpoint, key)
    return Demo(created.id, created.model_name, kept=False, agent_owned=False)


async def _wait_heartbeat(
    app: ServerApp, node_name: str, stop: asyncio.Event, since: datetime, timeout_s: float = 60.0
) -> bool:
    """Until the server has seen the local agent's heartbeat at or after ``since``.

    The first one after start tells the server the agent's volume rules: until then no
    node allows the demo's absolute model path and the create would be refused. The one
    after that means the agent has acted on the first reply (adopted or failed the tasks
    it was given).
    """
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not stop.is_set() and asyncio.get_running_loop().time() < deadline:
        seen = await asyncio.to_thread(_last_heartbeat, app, node_name)
        if seen is not None and seen >= since:
            return True
        await asyncio.sleep(0.2)
    return False


def _last_heartbeat(app: ServerApp, node_name: str) -> datetime | None:
    with app.db.session() as s:
        return s.scalar(select(Node.last_heartbeat_at).where(Node.name == node_name))


def _own_services(app: ServerApp) -> dict[str, str]:
    """The services of the last run up brings back, by id: every group but the demo's
    that is not deleted, stopped (it stays stopped) or failed (it had ended before)."""
    with app.db.session() as s:
        groups = s.scalars(
            select(TaskGroup).where(TaskGroup.deleted_at.is_(None), TaskGroup.name != DEMO_NAME)
        )
        return {
            g.id: g.name for g in groups if g.status not in ("stopped", "completed", "failed")
        }


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _demo_state(app: ServerApp, group_id: str) -> tuple[str, str]:
    """(group status, the first line of the first task status message)."""
    with app.db.session() as s:
        g = s.get(TaskGroup, group_id)
        if g is None:
            return "missing", ""
        messages = s.scalars(
            select(Task.status_message)
            .where(Task.group_id == group_id, Task.replaced_by == "")  # not replaced ones
            .order_by(Task.rank)
        )
        reason = next((m.strip().splitlines()[0] for m in messages if m and m.strip()), "")
        reason = reason.removesuffix("; last output:")  # the output follows in the message
        return g.status, reason


async def _wait_done(
    app: ServerApp, group_id: str, stop: asyncio.Event, elapsed: Elapsed,
    stale: tuple[str, str] | None = None,
) -> tuple[str, str]:
    """Print each change of the demo's status (and its task's reason) until it runs or
    ends; returns (status, reason). ``stale`` is a kept demo's state as the last run
    left it: its reason (e.g. the last shutdown's "agent shut down") is that run's
    news, not this one's, so it is not printed again."""
    last = ("", "")
    while not stop.is_set():
        status, reason = await asyncio.to_thread(_demo_state, app, group_id)
        if (status, reason) != last:
            shown = "" if (status, reason) == stale else reason
            say(f"  {elapsed} demo: {status}" + (f" — {shown}" if shown else ""))
            last = (status, reason)
        if status in DONE:
            break
        await asyncio.sleep(0.3)
    return last


def _instructions(base: str, model_name: str, key: str, key_file: Path) -> str:
    return textwrap.dedent(
        f"""
        HeteroFlow is up: API and OpenAI-compatible gateway on {base}
          API key: {key}  (the demo's, kept in {key_file})

          curl {base}/v1/chat/completions \\
            -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
            -d '{{"model": "{model_name}", "max_tokens": 32,
                 "messages": [{{"role": "user", "content": "Hello"}}]}}'

          {sys.executable} -c 'from openai import OpenAI
        c = OpenAI(base_url="{base}/v1", api_key="{key}")
        print(c.chat.completions.create(model="{model_name}", max_tokens=32,
              messages=[{{"role": "user", "content": "Hello"}}]).choices[0].message.content)'
        """
    )


# ---- the whole ----


@dataclass
class _Run:
    opts: UpOptions
    app: ServerApp
    base: str
    node_name: str
    stop: asyncio.Event
    elapsed: Elapsed
    started_at: datetime  # when the server started serving

    async def demo(self, model: Path, kind: str) -> None:
        """Deploy (or keep) the demo, report its progress, and say how to call it."""
        opts, app = self.opts, self.app
        key_file = opts.data_dir / DEMO_KEY_FILE
        # printed once it answers (issue 33: printed here, it got 401 until the demo ran)
        key = await asyncio.to_thread(demo_key, opts.data_dir)
        if not await _wait_heartbeat(app, self.node_name, self.stop, self.started_at):
            if not self.stop.is_set():
                say("the local agent did not register within 60 s; no demo deployed")
                say(f"  the demo's API key, once it runs: {key}  (kept in {key_file})")
            return
        req = _demo_request(model, kind)
        d = await asyncio.to_thread(_deploy_demo, app, req, key, keep=True)
        stale = None
        if d.kept:
            say(f"keeping the demo service {d.group_id} ({d.model_name}) from the last run")
            stale = await asyncio.to_thread(_demo_state, app, d.group_id)
            if d.agent_owned:  # the agent's first reply: adopt the engine, or give it back
                await _wait_heartbeat(app, self.node_name, self.stop, app.clock.now())
        else:
            say(f"deploying {d.model_name} from {model} as {d.group_id} …")
        status, reason = await _wait_done(app, d.group_id, self.stop, self.elapsed, stale)
        if status == "failed" and d.kept and not self.stop.is_set():
            say(f"  {self.elapsed} the last run's engine is gone; starting the demo again")
            d = await asyncio.to_thread(_deploy_demo, app, req, key, keep=False)
            say(f"deploying {d.model_name} from {model} as {d.group_id} …")
            status, reason = await _wait_done(app, d.group_id, self.stop, self.elapsed)
        if self.stop.is_set():
            return
        if status == "running":
            say(_instructions(self.base, d.model_name, key, key_file))
            return
        cli = cli_command()
        say(
            f"\nthe demo service {d.group_id} is {status}"
            + (f": {reason}" if reason else "")
            + f"\n  its API key (works once it runs): {key}  (kept in {key_file})"
            + f"\n  see why: {cli} services show {d.group_id}\n"
        )

    async def startup(self, picked: tuple[Path, str] | None, password_shown: bool) -> None:
        cli = cli_command()
        try:
            cli_line = await asyncio.to_thread(login_cli, self.app, self.base, cli)
        except Exception as exc:  # e.g. an unwritable CLI directory: say so, go on
            log.warning("the CLI login was not written", exc_info=True)
            cli_line = f"CLI: its login could not be written ({exc}); log in as below"
        say(management_hints(self.base, self.opts.data_dir, cli, cli_line, password_shown))
        names = await asyncio.to_thread(_own_services, self.app)
        if names:  # the last run's shutdown gave them back as scheduled: they start again
            say(
                f"restoring {_count(len(names), 'service')} of the last run: "
                + ", ".join(sorted(names.values()))
                + " (said here when each is back)"
            )
        if picked is not None:
            try:
                await self.demo(*picked)
            except Exception as exc:  # the server keeps serving; say what went wrong
                log.exception("the demo could not be deployed")
                say(f"the demo could not be deployed: {exc}")
        if not self.stop.is_set():
            say("Press Ctrl-C to stop (engines are stopped with it).")
        await self.own_services(names)

    async def own_services(self, names: dict[str, str]) -> None:
        """Issue 33: after a restart, say how the users' own services (``_own_services``)
        came back, once each has settled (running, failed or stopped), or after
        ``RESTORE_WATCH_S`` where each one is. Silent when there are none."""
        if not names:
            return
        deadline = asyncio.get_running_loop().time() + RESTORE_WATCH_S
        states: dict[str, tuple[str, str]] = {}
        while not self.stop.is_set():
            states = {g: await asyncio.to_thread(_demo_state, self.app, g) for g in names}
            if all(st in DONE for st, _ in states.values()):
                break
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.5)
        if self.stop.is_set():
            return
        for g, (status, reason) in sorted(states.items(), key=lambda kv: names[kv[0]]):
            more = f": {reason}" if reason and status != "running" else ""
            say(f"  {self.elapsed} {names[g]} ({g}): {status}{more}")


async def run_up(opts: UpOptions, lock: instance_lock.InstanceLock | None = None) -> int:
    elapsed = Elapsed()
    if isinstance(sys.stdout, io.TextIOWrapper):  # "…" and "—" on any terminal
        sys.stdout.reconfigure(errors="replace")
    # the settings first: a HETEROFLOW_* value that does not parse is refused before
    # the demo model is made or downloaded
    if opts.port_range is None:
        settings = ServerSettings(data_dir=opts.data_dir, host=opts.host, port=opts.port)
    else:
        settings = ServerSettings(
            data_dir=opts.data_dir,
            host=opts.host,
            port=opts.port,
            port_pool_start=opts.port_range[0],
            port_pool_end=opts.port_range[1],
        )
    opts.models_dir.mkdir(parents=True, exist_ok=True)
    # issue 33: the terminal is for up's progress; INFO lines go to the log file
    log_file = logs.to_file(opts.data_dir / LOG_FILE)
    picked = _pick_model(opts)
    overlap = ephemeral_overlap(settings.port_pool(), local_ephemeral_range())
    if overlap is not None:
        say(
            f"warning: engine ports {overlap.start}-{overlap.stop - 1} lie in this host's "
            "ephemeral range (net.ipv4.ip_local_port_range): outgoing connections may hold "
            "them, and a service placed on one is placed again; a --port-range below it "
            "avoids that"
        )
    app = ServerApp(settings)
    password = app.bootstrap.admin_password_generated
    if password:
        say(f"admin password (shown once): {password}")
    sock = bind(opts.host, opts.port)
    port = sock.getsockname()[1]
    base = f"http://{opts.host}:{port}"
    if lock is not None:  # the port it really got (--port 0), for a refused second `up`
        lock.describe(base)
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
    say(f"local agent: {opts.runtime} runtime")
    agent = Agent(agent_settings, node_cfg, launcher, app.clock)
    stop = asyncio.Event()
    install_stop_signals(stop)
    settle_heap()  # start-up is done: no GC pass walks its objects again (the gateway's tail)
    share_the_gil()  # the server's threads take turns every 1 ms
    server = asyncio.create_task(app.serve(stop, sock, extra=[agent.run]))
    say(f"HeteroFlow server on {base} (data: {opts.data_dir}, models: {opts.models_dir})")
    say(f"  its log: {log_file} (warnings and errors are shown here too)")
    run = _Run(opts, app, base, agent_settings.node_name, stop, elapsed, app.clock.now())
    startup = asyncio.create_task(run.startup(picked, password_shown=bool(password)))
    stopped = asyncio.create_task(stop.wait())
    await asyncio.wait({server, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if server.done() and not stop.is_set():  # the server ended by itself: say why
        startup.cancel()
        stopped.cancel()
        await server
        return 1
    say("stopping… (engines first, then the server)")
    await asyncio.gather(startup, return_exceptions=True)
    await server
    say("stopped")
    return 0


def run(a: argparse.Namespace) -> int:
    """``heteroflow up``'s arguments -> ``UpOptions``; the models default to DATA_DIR/models.

    Refused in one line before anything is touched (issue 33): a data directory another
    HeteroFlow runs on (``instance_lock``), and a ``--models-dir`` that is not an existing
    folder (a typo would otherwise be made into an empty folder the demo downloads into,
    and the user's models would silently not be there; the default one is made)."""
    data_dir = Path(a.data_dir).expanduser().resolve()
    models_dir = Path(a.models_dir).expanduser().resolve() if a.models_dir else data_dir / "models"
    if a.models_dir and not models_dir.is_dir():
        what = "is not a folder" if models_dir.exists() else "does not exist"
        raise CliError(f"--models-dir {models_dir} {what}: make it first, or leave it out")
    if a.agent_config and not Path(a.agent_config).is_file():
        raise CliError(f"--agent-config {a.agent_config}: no such file")
    lock = instance_lock.acquire(data_dir, "up", f"http://{a.host}:{a.port}")
    opts = UpOptions(
        data_dir=data_dir,
        models_dir=models_dir,
        host=a.host,
        port=a.port,
        demo=a.demo,
        agent_config=Path(a.agent_config) if a.agent_config else None,
        threads=a.threads,
        runtime=a.runtime,
        port_range=a.port_range,
    )
    try:
        return asyncio.run(run_up(opts, lock))
    finally:
        lock.release()
