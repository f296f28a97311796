"""A task's port mappings as a value: one type instead of string-keyed dicts.

A mapping says which container port a task listens on and which host port stands for
it (``host_port`` 0 = not chosen yet: the scheduler takes one from the pool). A port the
pool chose remembers it (``from_pool``): it may be given back and chosen again (a
preempted task queued again, a port found taken at launch, P2), while a fixed host port
an operator asked for stays what was asked. The JSON column ``tasks.ports`` and the agent
protocol keep the plain form ``{"container_port": int, "host_port": int}`` (plus
``"from_pool": true`` for a pool port); code converts at those edges (``from_dict`` /
``to_dict``) and works with ``PortMapping`` in between.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["PortMapping", "host_ports", "ports_from_dicts", "ports_to_dicts", "with_host_ports"]


@dataclass(frozen=True, slots=True)
class PortMapping:
    container_port: int
    host_port: int = 0  # 0 = from the pool, when the task is placed
    from_pool: bool = False  # the pool chose host_port (else it was asked for)

    def to_dict(self) -> dict[str, int | bool]:
        d: dict[str, int | bool] = {
            "container_port": self.container_port,
            "host_port": self.host_port,
        }
        if self.from_pool:
            d["from_pool"] = True
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PortMapping:
        return cls(int(d["container_port"]), int(d.get("host_port") or 0), bool(d.get("from_pool")))

    def released(self) -> PortMapping:
        """A pool port given back to the pool (0: chosen again at the next placement);
        a fixed host port stays as it was asked for."""
        return PortMapping(self.container_port, 0) if self.from_pool else self


def ports_from_dicts(items: Iterable[Mapping[str, Any]]) -> tuple[PortMapping, ...]:
    return tuple(PortMapping.from_dict(d) for d in items)


def ports_to_dicts(ports: Iterable[PortMapping]) -> list[dict[str, int | bool]]:
    return [p.to_dict() for p in ports]


def host_ports(ports: Iterable[PortMapping], *, chosen_only: bool = False) -> tuple[int, ...]:
    """The host ports in order (0 where the pool will choose; ``chosen_only`` skips those)."""
    return tuple(p.host_port for p in ports if p.host_port or not chosen_only)


def with_host_ports(ports: Sequence[PortMapping], chosen: Sequence[int]) -> tuple[PortMapping, ...]:
    """The mappings with the host ports a placement chose, one per mapping, in order
    (a mapping that had none takes the pool's, and remembers it came from the pool)."""
    return tuple(
        p if p.host_port else PortMapping(p.container_port, hp, from_pool=True)
        for p, hp in zip(ports, chosen, strict=True)
    )


def ephemeral_overlap(pool: range, ephemeral: tuple[int, int] | None) -> range | None:
    """The part of the host-port pool inside the kernel's ephemeral range, if any.

    Outgoing connections take their local port from that range, and a socket bound to a
    port that way keeps an engine from listening on it even though nothing *listens*
    there (so a heartbeat's ``host_ports_in_use`` cannot show it): a task placed on such
    a port meets it at launch and is placed again (P2). A pool below the range (the
    default, 20000-29999, against Linux's 32768-60999) never does.
    """
    if ephemeral is None:
        return None
    low, high = max(pool.start, ephemeral[0]), min(pool.stop - 1, ephemeral[1])
    return range(low, high + 1) if low <= high else None


def local_ephemeral_range(
    path: str = "/proc/sys/net/ipv4/ip_local_port_range",
) -> tuple[int, int] | None:
    """This host's ephemeral port range (Linux), or None where it cannot be read."""
    try:
        with open(path) as f:
            first, last = (int(x) for x in f.read().split()[:2])
    except (OSError, ValueError):
        return None
    return first, last
