"""Hosts on this machine for tests of what crosses a network: a bridge in this
namespace (the control plane's side) and one network namespace per other host, each
with its own address on the bridge. Needs root and iproute2's ``ip``; skipped without
them unless ``HETEROFLOW_REQUIRE_NETNS=1`` (``.ci/run``), where it fails instead."""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass

import pytest


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@dataclass
class Net:
    """A bridge in this namespace (the control plane's side) and one namespace per node."""

    bridge: str
    host_ip: str  # the bridge's address: where the nodes reach the servers
    nodes: list[tuple[str, str]]  # (namespace, its address)

    def kill_node(self, namespace: str) -> list[int]:
        """SIGKILL every process in ``namespace``: the machine is gone."""
        out = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
        ).stdout
        pids = [int(p) for p in out.split()]
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids


def _free_subnet() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    for _ in range(50):
        net = ipaddress.IPv4Network(f"10.{random.randint(100, 250)}.{random.randint(0, 255)}.0/24")
        if f" {str(net.network_address)[:-1]}" not in used:
            return net
    raise RuntimeError("no free 10.x.y.0/24 for the test bridge")


@contextmanager
def network(nodes: int) -> Iterator[Net]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        reason = "network namespaces need root and iproute2's ip"
        if os.environ.get("HETEROFLOW_REQUIRE_NETNS") == "1":
            pytest.fail(f"{reason} (HETEROFLOW_REQUIRE_NETNS=1)")
        pytest.skip(reason)
    tag = secrets.token_hex(2)
    subnet = _free_subnet()
    hosts = list(subnet.hosts())
    bridge = f"hfbr{tag}"
    net = Net(bridge, str(hosts[0]), [])
    try:
        ip("link", "add", bridge, "type", "bridge")
        ip("addr", "add", f"{hosts[0]}/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for i in range(1, nodes + 1):
            ns, veth, address = f"hf{tag}n{i}", f"hfv{tag}{i}", str(hosts[10 + i])
            ip("netns", "add", ns)
            net.nodes.append((ns, address))
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", bridge, "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
        yield net
    finally:
        for ns, _ in net.nodes:
            net.kill_node(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True, check=False)
