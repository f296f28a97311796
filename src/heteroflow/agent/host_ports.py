"""The TCP ports something listens on at this host, whatever holds them (P2).

The agent reports them in every heartbeat so the server's port pool hands out only ports
that are really free here. On Linux they are read from ``/proc/net/tcp`` and
``/proc/net/tcp6`` (state ``0A`` = LISTEN): cheap, no privileges, every process's
sockets, including a container runtime's published ports. Elsewhere psutil answers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

_LISTEN = "0A"
PROC_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


def parse_proc_net_tcp(lines: Iterable[str]) -> set[int]:
    """Listening ports in one ``/proc/net/tcp``-format table (the header line skipped)."""
    ports: set[int] = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 4 or fields[3] != _LISTEN or ":" not in fields[1]:
            continue
        try:
            ports.add(int(fields[1].rsplit(":", 1)[1], 16))
        except ValueError:
            continue
    return ports


def listening_ports(tables: tuple[Path, ...] = PROC_TABLES, limit: int = 8192) -> list[int]:
    """This host's listening TCP ports, lowest first, at most ``limit`` of them."""
    ports: set[int] = set()
    read_any = False
    for table in tables:
        try:
            text = table.read_text()
        except OSError:
            continue
        read_any = True
        ports |= parse_proc_net_tcp(text.splitlines()[1:])
    if not read_any:
        try:
            ports = {
                c.laddr.port
                for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr
            }
        except (psutil.Error, OSError) as exc:  # e.g. macOS without privileges
            log.info("cannot list this host's listening ports: %s", exc)
    return sorted(p for p in ports if 0 < p < 65536)[:limit]
