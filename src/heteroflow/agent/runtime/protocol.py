"""The runtime interface: what the agent needs from anything that runs engines.

Two implementations share it: the plain-process runtime (here, for hosts without Docker
and for the test suite) and the Docker runtime (its own work item).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from heteroflow.core.images import PullFailure, failure_text


@dataclass(frozen=True, slots=True)
class LaunchSpec:
    task_id: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    host_ports: tuple[int, ...] = ()
    log_path: Path | None = None
    host: str = "127.0.0.1"  # the address the engine listens on (its ports checked there)


class PortInUse(Exception):
    """Host ports the task needs are already bound (``ports``: the ones found taken, or
    every port the launch asked for when the runtime cannot tell which)."""

    def __init__(self, message: str, ports: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.ports = ports


class LaunchFailed(Exception):
    pass


class ContainerGone(LaunchFailed):
    """A wake found the task's kept container gone (F3): the task cannot resume here."""


class PullFailed(LaunchFailed):
    """H7: a pull that did not bring the image; ``kind`` says why (``PullFailure``), the
    message is the task's status line (``core.images.failure_text``)."""

    def __init__(self, image: str, kind: PullFailure, detail: str) -> None:
        super().__init__(failure_text(image, kind, detail))
        self.image = image
        self.kind = kind


class Runtime(Protocol):
    """What the agent's loops need from a runtime; starting is the launcher's business."""

    name: str

    def exit_code(self, task_id: str) -> int | None:
        """None while running; the exit code once it has exited."""
        ...

    def stop(self, task_id: str, timeout_s: float) -> None: ...

    def halt(self, task_id: str, timeout_s: float) -> None:
        """Stop the engine of a task going to sleep (F1), keeping what its wake needs:
        the container (Docker); nothing (a process is launched again with its argv)."""
        ...

    def running(self) -> list[str]: ...

    def managed(self) -> dict[str, str]:
        """Task id -> state ("running", "exited", ...) of everything this agent runs."""
        ...

    def remove(self, task_id: str) -> None:
        """Force-remove something this agent started (zombie cleanup)."""
        ...

    def forget(self, task_id: str) -> None: ...

    def log_tail(self, task_id: str, lines: int) -> str: ...
