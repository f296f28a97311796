"""Docker runtime: runs a task's ``ContainerPlan`` as a container on the node's Docker Engine.

Owns the translation of a plan (``core/containers.py``) into Engine API calls and the
bookkeeping by labels. Every container it creates is named ``plan.name`` (the task id,
``task-`` + 12 hex digits; other names are refused) and labelled
``heteroflow.managed=true``, ``heteroflow.node=<node id>``, ``heteroflow.agent=<agent id>``.
Listing, stopping and removing act only on containers carrying this agent's labels, never
on a name alone, so a user's own containers on the same Engine are left alone.

Images are pulled when absent, one pull per image (``pulls.ImagePuller``, ``images``);
the launcher asks for the image before ``start``, so a missing image here means it went
away in between (a prune) and fails the launch with that reason. A port already bound
on the host raises :class:`PortInUse` (the caller backs off and retries); other Engine
errors raise :class:`LaunchFailed`. Containers run with ``init=True`` so a stop
is immediate even when the engine ignores SIGTERM as PID 1, and with a rotated json-file
log so :meth:`DockerRuntime.logs_since` can ship logs incrementally.
"""

from __future__ import annotations

import calendar
import logging
import math
import re
import time
from typing import Any

import docker
import docker.errors
import docker.types

from heteroflow.agent.runtime.protocol import ContainerGone, LaunchFailed, PortInUse
from heteroflow.agent.runtime.pulls import ImagePuller
from heteroflow.core.containers import ContainerPlan

log = logging.getLogger(__name__)

TASK_NAME = re.compile(r"^task-[0-9a-f]{12}$")
LABEL_MANAGED = "heteroflow.managed"
LABEL_NODE = "heteroflow.node"
LABEL_AGENT = "heteroflow.agent"
LOG_CONFIG = {"max-size": "20m", "max-file": "3"}
_PORT_IN_USE = ("address already in use", "port is already allocated")
_EXITED = ("exited", "dead")
_SINCE_SLACK_NS = 1_000  # a float epoch carries ~240 ns; lines this close to `since` are seen


def _check_name(task_id: str) -> None:
    if not TASK_NAME.match(task_id):
        raise ValueError(f"not a task container name: {task_id!r} (expected task-<12 hex>)")


def _parse_ts_ns(stamp: str) -> int | None:
    """RFC 3339 (nano) UTC timestamp as Docker writes it, e.g. ``2026-01-02T03:04:05.12Z``."""
    if len(stamp) < 20 or not stamp.endswith("Z"):
        return None
    try:
        seconds = calendar.timegm(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))
        fraction = stamp[20:-1] if stamp[19] == "." else ""
        nanos = int(fraction.ljust(9, "0")[:9]) if fraction else 0
    except ValueError:
        return None
    return seconds * 1_000_000_000 + nanos


class DockerRuntime:
    """Runs plans as labelled containers; see the module docstring for what it owns."""

    name = "docker"

    def __init__(self, client: docker.DockerClient, *, node_id: str, agent_id: str) -> None:
        self.client = client
        self.node_id = node_id
        self.agent_id = agent_id
        self._filters = {"label": [f"{LABEL_MANAGED}=true", f"{LABEL_AGENT}={agent_id}"]}
        self.images = ImagePuller(client)  # H7: pulled when absent, one pull per image

    # -- ownership ---------------------------------------------------------------------

    def _ours(self, labels: dict[str, str] | None) -> bool:
        labels = labels or {}
        return labels.get(LABEL_MANAGED) == "true" and labels.get(LABEL_AGENT) == self.agent_id

    def _attrs(self, task_id: str) -> dict[str, Any] | None:
        """The container's inspect data when it exists and carries this agent's labels."""
        _check_name(task_id)
        try:
            attrs: dict[str, Any] = self.client.api.inspect_container(task_id)
        except docker.errors.NotFound:
            return None
        if not self._ours((attrs.get("Config") or {}).get("Labels")):
            return None
        return attrs

    def _list(self, *, all_states: bool) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.client.api.containers(
            all=all_states, filters=self._filters
        )
        return [c for c in found if self._ours(c.get("Labels")) and self._task_of(c)]

    @staticmethod
    def _task_of(summary: dict[str, Any]) -> str | None:
        for name in summary.get("Names") or ():
            name = str(name).lstrip("/")
            if TASK_NAME.match(name):
                return name
        return None

    # -- launch ------------------------------------------------------------------------

    def _create_kwargs(self, plan: ContainerPlan) -> dict[str, Any]:
        labels = {
            **{str(k): str(v) for k, v in plan.labels.items()},
            LABEL_MANAGED: "true",
            LABEL_NODE: self.node_id,
            LABEL_AGENT: self.agent_id,
        }
        env = dict(plan.env)
        kwargs: dict[str, Any] = {
            "name": plan.name,
            "labels": labels,
            "init": True,
            "detach": True,
            "mounts": [
                docker.types.Mount(m.target, m.source, type="bind", read_only=m.read_only)
                for m in plan.mounts
            ],
            "log_config": docker.types.LogConfig(type="json-file", config=LOG_CONFIG),
            # the task's image, command and env are a tenant member's: confine them
            "privileged": plan.security.privileged,
            "cap_drop": list(plan.security.cap_drop),
            "cap_add": list(plan.security.cap_add),
            "security_opt": list(plan.security.security_opt),
            "pids_limit": plan.security.pids_limit,
        }
        if plan.network_mode != "host":
            kwargs["ports"] = {f"{port}/tcp": bind for port, bind in plan.ports.items()}
        if plan.entrypoint is not None:
            kwargs["entrypoint"] = list(plan.entrypoint)
        for key, value in (
            ("ipc_mode", plan.ipc_mode),
            ("shm_size", plan.shm_size),
            ("network_mode", plan.network_mode),
        ):
            if value is not None:
                kwargs[key] = value
        if plan.gpu is not None:
            env.update(plan.gpu.env)
            if plan.gpu.vendor == "nvidia":
                kwargs["device_requests"] = [
                    docker.types.DeviceRequest(
                        device_ids=list(plan.gpu.device_ids), capabilities=[["gpu"]]
                    )
                ]
            if plan.gpu.devices:
                kwargs["devices"] = [f"{d}:{d}:rwm" for d in plan.gpu.devices]
            if plan.gpu.group_add:
                kwargs["group_add"] = list(plan.gpu.group_add)
        kwargs["environment"] = env
        return kwargs

    def start(self, plan: ContainerPlan) -> None:
        """Create and start the plan's container; removes it again if it cannot start."""
        _check_name(plan.name)
        try:
            container = self.client.containers.create(
                plan.image, list(plan.command), **self._create_kwargs(plan)
            )
        except docker.errors.ImageNotFound as exc:
            raise LaunchFailed(
                f"image {plan.image!r} is not present on this node (removed after its pull?); "
                f"the next launch pulls it again"
            ) from exc
        except docker.errors.APIError as exc:
            raise self._launch_error(plan, exc) from exc
        try:
            container.start()
        except docker.errors.APIError as exc:
            try:
                container.remove(force=True)
            except docker.errors.APIError:
                log.warning("could not remove container %s after a failed start", plan.name)
            raise self._launch_error(plan, exc) from exc
        log.info("started container %s from %s", plan.name, plan.image)

    @staticmethod
    def _launch_error(plan: ContainerPlan, exc: docker.errors.APIError) -> Exception:
        text = str(exc.explanation or exc)
        if any(marker in text.lower() for marker in _PORT_IN_USE):
            ports = ", ".join(f"{ip}:{port}" for ip, port in plan.ports.values())
            asked = tuple(int(port) for _ip, port in plan.ports.values())
            named = tuple(p for p in asked if re.search(rf":{p}\b", text))
            return PortInUse(f"host port already in use ({ports}): {text}", named or asked)
        return LaunchFailed(f"container {plan.name} failed to start: {text}")

    # -- state -------------------------------------------------------------------------

    def exit_code(self, task_id: str) -> int | None:
        """None while it runs; its exit code once exited/dead; -1 when it is gone."""
        attrs = self._attrs(task_id)
        if attrs is None:
            return -1
        state = attrs.get("State") or {}
        if state.get("Status") in _EXITED:
            return int(state.get("ExitCode", -1))
        return None

    def stop(self, task_id: str, timeout_s: float) -> None:
        """Stop (SIGTERM, SIGKILL after ``timeout_s``), then remove; a missing one is fine."""
        if self._attrs(task_id) is None:
            return
        try:
            self.client.api.stop(task_id, timeout=max(0, math.ceil(timeout_s)))
        except docker.errors.NotFound:
            return
        self.remove(task_id)

    def halt(self, task_id: str, timeout_s: float) -> None:
        """Sleep (F1): stop the container (SIGTERM, SIGKILL after ``timeout_s``) and KEEP
        it, so the wake starts the same container again; a missing one is fine."""
        if self._attrs(task_id) is None:
            return
        try:
            self.client.api.stop(task_id, timeout=max(0, math.ceil(timeout_s)))
        except docker.errors.NotFound:
            return

    def resume(self, task_id: str) -> None:
        """Wake (F2, C2's resume branch): start the task's existing container again.

        ``ContainerGone`` when it is not there any more (F3), ``PortInUse`` when its
        host port was taken meanwhile, ``LaunchFailed`` for other Engine errors. Starting
        a container that already runs is a no-op."""
        if self._attrs(task_id) is None:
            raise ContainerGone(f"container {task_id} gone at wake")
        try:
            self.client.api.start(task_id)
        except docker.errors.NotFound as exc:
            raise ContainerGone(f"container {task_id} gone at wake") from exc
        except docker.errors.APIError as exc:
            text = str(exc.explanation or exc)
            if any(marker in text.lower() for marker in _PORT_IN_USE):
                bound = re.findall(r":(\d+)\b", text)
                raise PortInUse(
                    f"host port already in use at wake: {text}",
                    tuple(int(p) for p in bound[-1:]),
                ) from exc
            raise LaunchFailed(f"container {task_id} failed to start again: {text}") from exc
        log.info("started container %s again (wake)", task_id)

    def remove(self, task_id: str) -> None:
        """Force-remove the container, only when it carries this agent's labels."""
        if self._attrs(task_id) is None:
            return
        try:
            self.client.api.remove_container(task_id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as exc:
            if "already in progress" not in str(exc):
                raise

    def running(self) -> list[str]:
        """Task ids of this agent's running containers (by label, never by name alone)."""
        return sorted(t for c in self._list(all_states=False) if (t := self._task_of(c)))

    def managed(self) -> dict[str, str]:
        """Task id -> container state of every container carrying this agent's labels."""
        out: dict[str, str] = {}
        for summary in self._list(all_states=True):
            if task := self._task_of(summary):
                out[task] = str(summary.get("State", ""))
        return out

    def forget(self, task_id: str) -> None:
        """Nothing is kept in memory: the Engine is the record."""

    def inspect(self, task_id: str) -> dict[str, Any]:
        """The Engine's inspect data for one of this agent's containers ({} when none)."""
        return self._attrs(task_id) or {}

    # -- logs --------------------------------------------------------------------------

    def log_tail(self, task_id: str, lines: int) -> str:
        if self._attrs(task_id) is None:
            return ""
        try:
            raw: bytes = self.client.api.logs(task_id, stdout=True, stderr=True, tail=lines)
        except docker.errors.NotFound:
            return ""
        return raw.decode("utf-8", "replace").rstrip("\n")

    def logs_since(self, task_id: str, since: float | None, tail: int = 2000) -> tuple[str, float]:
        """Lines logged after ``since`` (epoch seconds; None: the last ``tail`` lines).

        Returns the text and the value to pass next time (the newest timestamp seen: Docker
        copies stdout and stderr on separate goroutines, so the log's order need not follow
        the timestamps and the last line is not always the newest), so repeated calls ship
        each line once; at most ``tail`` lines come back per call.
        """
        start = since if since is not None and since > 0 else 0.0
        if self._attrs(task_id) is None:
            return "", start
        kwargs: dict[str, Any] = {"stdout": True, "stderr": True, "timestamps": True}
        kwargs["tail"] = tail
        if start > 0:
            kwargs["since"] = start
        try:
            raw: bytes = self.client.api.logs(task_id, **kwargs)
        except docker.errors.NotFound:
            return "", start
        floor_ns = round(start * 1e9) + _SINCE_SLACK_NS if start > 0 else -1
        out: list[str] = []
        last_ns: int | None = None
        for line in raw.decode("utf-8", "replace").splitlines(keepends=True):
            stamp, _, text = line.partition(" ")
            ts_ns = _parse_ts_ns(stamp)
            if ts_ns is None:
                out.append(line)
                continue
            if ts_ns <= floor_ns:
                continue
            out.append(text)
            last_ns = ts_ns if last_ns is None else max(last_ns, ts_ns)
        return "".join(out), (last_ns / 1e9 if last_ns is not None else start)
