"""LoRA adapters loaded into running engines at runtime (core.lora), on the node.

Each heartbeat lists, per task, its group's adapters (``TaskAssignment.lora_adapters``);
after the convergence the agent starts one round (``_sync_adapters``; never more than one
at a time, beside the heartbeat so that a slow engine cannot delay it). For every engine
it runs that has LoRA slots (``max_loras``) and has passed its first health check, the
round compares the list with what it loaded (``core.lora.plan_sync``) and calls the
engine itself over the node's loopback with its key — the door never lets these routes
through (``core.engine_access.PLATFORM_ONLY``): ``POST /v1/unload_lora_adapter`` for
what left the list, ``POST /v1/load_lora_adapter`` for what joined it. No restart.

Before a load the adapter's folder is checked where the files are (the agent is the
security boundary, as for a model): the node's volume rule on the lexical path and on
its real path (no symlink out), a folder holding ``adapter_config.json``; in a
container it must lie under one of the task's volumes (``core.lora.engine_path``).

A failed load (a refused path, an engine that answers an error or nothing) is tried
again after ``lora_retry_base_s``, doubling up to ``lora_retry_max_s``, and reported —
the task's status message and a ``task.lora_adapter`` event — once per change of what
the engine serves or why it cannot, never as a failure of the task: the base model and
the other adapters keep serving. Engine state is forgotten when an engine stops or
sleeps (a woken engine starts without adapters); after an agent restart the engine's
"already loaded" answer counts as loaded.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from heteroflow.agent.launch import host_port_for
from heteroflow.agent.runtime.protocol import LaunchFailed
from heteroflow.agent.state import AgentState, Outgoing
from heteroflow.core.containers import DATA_MODELS
from heteroflow.core.engines.registry import ENGINES
from heteroflow.core.lora import (
    LOAD_PATH,
    UNLOAD_PATH,
    Adapter,
    adapter_path_refusal,
    adapters_of,
    engine_path,
    host_path,
    plan_sync,
    retry_delay_s,
)
from heteroflow.core.paths import VolumeRule, inside, volume_allows
from heteroflow.schemas.nodes import TaskAssignment

log = logging.getLogger(__name__)

ADAPTER_NOTE = "adapter"  # the report's note: an event and the status message
ADAPTER_CONFIG = "adapter_config.json"
_ALREADY = "already been loaded"  # vLLM's 400 for a name it holds (an agent restart)
_MAX_ERROR = 300  # characters of an engine's error kept in a message


@dataclass
class EngineAdapters:
    """What one engine holds, as this agent loaded it, and its failed loads."""

    loaded: dict[str, str] = field(default_factory=dict)  # name -> host path
    failures: dict[str, int] = field(default_factory=dict)  # name -> failed loads in a row
    due: dict[str, float] = field(default_factory=dict)  # name -> next try (monotonic)
    why: dict[str, str] = field(default_factory=dict)  # name -> the last failure
    said: str = ""  # the last message reported


class Adapters(AgentState):
    """The agent's part that loads LoRA adapters into running engines."""

    _lora_engines: dict[str, EngineAdapters] | None = None
    _lora_round: asyncio.Task[None] | None = None

    def _sync_adapters(self) -> None:
        """Start a round of adapter loading, unless one still runs."""
        if self._lora_round is not None and not self._lora_round.done():
            return
        self._lora_round = asyncio.get_running_loop().create_task(self._adapter_round())

    async def _adapter_round(self) -> None:
        if self._lora_engines is None:
            self._lora_engines = {}
        engines = self._lora_engines
        for task_id in list(engines):
            loc = self.local.get(task_id)
            if loc is None or not loc.reported_running:  # stopped, asleep or restarted
                del engines[task_id]
        for task_id, loc in list(self.local.items()):
            t = loc.task
            spec = ENGINES.get(t.engine)
            if not t.max_loras or spec is None or not spec.runtime_lora:
                continue
            if not loc.reported_running or task_id in self.stopping:
                continue
            try:
                await self._sync_engine(t, engines.setdefault(task_id, EngineAdapters()))
            except Exception:  # never the agent's crash: the next round tries again
                log.exception("task %s: LoRA adapter round failed", task_id)

    async def _sync_engine(self, t: TaskAssignment, st: EngineAdapters) -> None:
        wanted = adapters_of(t.lora_adapters)
        plan = plan_sync(wanted, st.loaded)
        for name in plan.unload:
            gone, why = await self._engine_call(t, UNLOAD_PATH, {"lora_name": name})
            if gone or why.startswith("HTTP 404"):
                st.loaded.pop(name, None)
                log.info("task %s: LoRA adapter %r unloaded", t.id, name)
            else:
                log.warning("task %s: LoRA adapter %r not unloaded: %s", t.id, name, why)
        now = self.clock.monotonic()
        for a in plan.load:
            if st.due.get(a.name, 0.0) > now:
                continue
            why = await self._load(t, a)
            if why:
                n = st.failures.get(a.name, 0) + 1
                st.failures[a.name] = n
                delay = retry_delay_s(
                    n, self.settings.lora_retry_base_s, self.settings.lora_retry_max_s
                )
                st.due[a.name] = now + delay
                st.why[a.name] = f"{why} (try {n}; next in {delay:.0f} s)"
                log.warning("task %s: LoRA adapter %r not loaded: %s", t.id, a.name, why)
            else:
                st.loaded[a.name] = a.path
                for d in (st.failures, st.due, st.why):
                    d.pop(a.name, None)
                log.info("task %s: LoRA adapter %r loaded from %s", t.id, a.name, a.path)
        names = {a.name for a in wanted}
        for d in (st.failures, st.due, st.why):  # adapters removed meanwhile
            for name in [n for n in d if n not in names]:
                d.pop(name)
        await self._say(t, st)

    async def _say(self, t: TaskAssignment, st: EngineAdapters) -> None:
        """Report what the engine serves, or why an adapter is not loaded, when it changed."""
        if st.why:
            message = "; ".join(
                f"LoRA adapter {name!r} not loaded: {why}" for name, why in sorted(st.why.items())
            )
        elif st.loaded:
            message = "serving LoRA adapter(s): " + ", ".join(sorted(st.loaded))
        else:
            message = "no LoRA adapter loaded" if st.said else ""
        if message == st.said or t.id in self.outbox:  # never hides an outcome waiting
            return
        st.said = message
        self.outbox[t.id] = Outgoing("running", message, note=ADAPTER_NOTE)
        await self._flush_outbox()

    async def _load(self, t: TaskAssignment, a: Adapter) -> str:
        """Load one adapter into ``t``'s engine; why not ("" when loaded)."""
        refused = self._adapter_refusal(a)
        if refused:
            return refused
        volumes = [
            (str(v.get("host_path", "")), str(v.get("container_path", ""))) for v in t.volumes
        ]
        runtime = "process" if self.runtime.name == "process" else "docker"
        where = engine_path(a.path, runtime, volumes)
        if where is None:
            return (
                f"{a.path} is not under any of the task's volumes, so its container cannot "
                "read it: mount its folder with task.volumes"
            )
        ok, why = await self._engine_call(t, LOAD_PATH, {"lora_name": a.name, "lora_path": where})
        if ok or (why.startswith("HTTP 400") and _ALREADY in why):
            return ""
        return why

    def _adapter_refusal(self, a: Adapter) -> str:
        """The node's own check of an adapter's folder (the agent is the boundary)."""
        allowed, denied = self.config.allowed_volume_prefixes, self.config.denied_volume_prefixes
        problem = adapter_path_refusal(a.path, [VolumeRule(allowed, denied)], "of this node")
        if problem:
            return problem
        host = host_path(a.path)
        real = os.path.realpath(host)
        if a.path.startswith("/"):
            if not volume_allows(real, allowed, denied):
                return f"{a.path} leads outside the node's allowed volume prefixes ({real})"
        elif not inside(real, [os.path.realpath(DATA_MODELS)]):
            return f"{a.path} leads outside the node's model directory ({real})"
        if not os.path.isfile(os.path.join(real, ADAPTER_CONFIG)):
            return f"{host} is not an adapter folder (no {ADAPTER_CONFIG} there)"
        return ""

    async def _engine_call(
        self, t: TaskAssignment, path: str, body: dict[str, Any]
    ) -> tuple[bool, str]:
        """POST ``body`` to the engine itself over the loopback: (done, why not)."""
        try:
            port = host_port_for(t)
        except LaunchFailed as exc:
            return False, str(exc)
        url = f"http://{self.launcher.probe_host_for(t, port)}:{port}{path}"
        headers = {"Authorization": f"Bearer {t.engine_key}"} if t.engine_key else {}
        timeout = aiohttp.ClientTimeout(total=self.settings.lora_load_timeout_s)
        try:
            async with self._session().post(
                url, json=body, headers=headers, timeout=timeout
            ) as r:
                if r.status < 300:
                    return True, ""
                text = (await r.text())[:_MAX_ERROR * 2]
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return False, f"the engine did not answer ({type(exc).__name__})"
        return False, f"HTTP {r.status}: {_error_text(text)}"


def _error_text(text: str) -> str:
    """The engine's error message (OpenAI's shape), else its text, shortened."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    err = data.get("error") if isinstance(data, dict) else None
    if isinstance(err, dict) and isinstance(err.get("message"), str):
        text = err["message"]
    elif isinstance(err, str):
        text = err
    text = " ".join(text.split())
    return text[:_MAX_ERROR] + ("…" if len(text) > _MAX_ERROR else "")
