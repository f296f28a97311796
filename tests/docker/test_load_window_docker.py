"""D5 on a real Docker Engine: the container's own counters, and a hung container stopped.

* The Docker meter reads what a container read from the disk and its CPU from the
  Engine's one-shot stats: a container reading a file (dropped from the page cache)
  through Docker's own ``--device-read-bps`` limit shows its bytes growing at that rate —
  the throttle the issue names works here as well (cgroup v1 ``blkio`` under this dockerd).
* The agent's watch, with the real Docker runtime, meter and health probe: a container
  that never answers, reads nothing and logs nothing is stopped once nothing moved for
  ``load_stall_s`` — not at the old fixed window — with the reason, and removed.
"""

from __future__ import annotations

import asyncio
import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.daemon import Agent
from heteroflow.agent.inventory import NvmlDiscovery
from heteroflow.agent.launch import NoDoors
from heteroflow.agent.load_progress import DockerMeter, meter_for
from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.core.clock import FakeClock
from heteroflow.core.containers import Mount
from heteroflow.core.loading import LoadPolicy
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.settings import AgentSettings
from heteroflow.testing.slow_disk import SlowDiskUnavailable, disk_of, drop_cache
from tests.conftest import free_port
from tests.docker.conftest import make_plan, new_task_id, wait_until

RATE = 20_000_000  # bytes a second


@pytest.mark.feature("D5")
def test_the_docker_meter_follows_a_throttled_read_and_the_cpu(
    runtime: DockerRuntime, docker_client: Any, busybox_image: str, tmp_path: Path
) -> None:
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x5a" * (60 << 20))
    try:
        disk = disk_of(blob)
    except SlowDiskUnavailable as exc:
        pytest.skip(f"no disk to count reads of: {exc}")
    dev = next((p for p in Path("/dev").iterdir() if _is_dev(p, disk)), None)
    if dev is None:
        pytest.skip(f"no device node for disk {disk}")
    drop_cache(blob)
    name = new_task_id()
    plan = make_plan(
        busybox_image,
        ("sh", "-c", "cat /m/weights.bin > /dev/null; echo read-it; sleep 300"),
        name=name,
        mounts=(Mount(str(tmp_path), "/m", read_only=True),),
    )
    kwargs = runtime._create_kwargs(plan)  # the runtime's own container, plus a slow disk
    kwargs["device_read_bps"] = [{"Path": str(dev), "Rate": RATE}]
    docker_client.containers.create(plan.image, list(plan.command), **kwargs).start()
    meter = meter_for(runtime)
    assert isinstance(meter, DockerMeter)
    began = time.monotonic()
    seen: list[int] = []
    while "read-it" not in runtime.log_tail(name, 5):
        used = meter.usage(name, disk)
        assert used.read_bytes is not None and used.cpu_s is not None, used
        seen.append(used.read_bytes)
        assert time.monotonic() - began < 30, seen
        time.sleep(0.3)
    took = time.monotonic() - began
    final = meter.usage(name, disk).read_bytes or 0
    assert final >= 60 << 20
    # 60 MB at 20 MB/s: about three seconds, the counter growing all along
    assert took >= 2, took
    assert len({b for b in seen if 0 < b < final}) >= 3, seen


def _is_dev(path: Path, disk: str) -> bool:
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISBLK(st.st_mode) and f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}" == disk


class HungLauncher(NoDoors):
    """Starts a task as a busybox container that never answers, reads or logs anything."""

    def __init__(self, runtime: DockerRuntime, image: str) -> None:
        self.runtime = runtime
        self.image = image

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        command = ("sleep", "300")
        self.runtime.start(make_plan(self.image, command, name=t.id))
        return command

    def engines(self) -> dict[str, str]:
        return {"vllm": self.image}

    def log_source(self, task_id: str, since: str) -> tuple[str, str]:
        return "", since


class Reports:
    """The agent's server client, reduced to what this test reads."""

    node_id = "node-test"

    def __init__(self) -> None:
        self.reports: list[tuple[str, str, str | None, str | None]] = []

    async def report(
        self, task_id: str, status: str, message: str = "", argv: Any = None,
        fault: str | None = None, busy_ports: tuple[int, ...] = (), note: str | None = None,
    ) -> str:
        self.reports.append((status, message, fault, note))
        return status

    async def aclose(self) -> None:
        pass


class NoLogs:
    async def ship_once(self, task_ids: list[str]) -> None:
        pass

    def forget(self, task_id: str) -> None:
        pass


@pytest.mark.feature("D5")
def test_a_hung_container_is_stopped_when_its_load_stalls_not_at_a_fixed_window(
    runtime: DockerRuntime, busybox_image: str, tmp_path: Path
) -> None:
    settings = AgentSettings(
        server_url="http://server", node_token="t", node_name="node-test", runtime="docker",
        work_dir=tmp_path / "agent", stop_timeout_s=2,
    )
    clock = FakeClock()
    agent = Agent(
        settings, NodeConfig(), HungLauncher(runtime, busybox_image),  # type: ignore[arg-type]
        clock, nvml=NvmlDiscovery(platform="none"),
    )
    client = Reports()
    agent.client = client  # type: ignore[assignment]
    agent.shipper = NoLogs()  # type: ignore[assignment]
    agent.load_policy = LoadPolicy(stall_s=20, ceiling_s=3600)
    port = free_port()  # nothing will listen there: every probe is refused
    t = TaskAssignment(
        id=new_task_id(), group_id="tg-0123456789ab", name="hung-0", status="starting",
        task_type="inference", model_name="m", model_path="", image=busybox_image,
        engine="vllm", command=[], engine_args=[], env=[],
        ports=[{"container_port": 8000, "host_port": port, "from_pool": True}],
        gpu_ids=[], gpu_required=0, memory_mb=0,
        health_check={"interval_seconds": 1, "start_period_seconds": 5,
                      "unhealthy_threshold": 3},
    )

    async def drive() -> float:
        await agent._launch(t, attempt=1, first_try=clock.monotonic())
        began = clock.monotonic()
        try:
            while t.id in agent.local:
                clock.advance(1)
                await agent.watch_once()
                assert clock.monotonic() - began <= 40, client.reports
        finally:
            if agent._http is not None:
                await agent._http.close()
        return clock.monotonic() - began

    took = asyncio.run(drive())
    # the old window (5 s + 3 failures 1 s apart) would have killed it after ~8 s
    assert 20 <= took <= 23, (took, client.reports)
    notes = [r for r in client.reports if r[3] is not None]
    assert notes[0][:2] == ("starting", "loading: model size unknown here; no expected time")
    status, message, fault, _ = client.reports[-1]
    assert (status, fault) == ("failed", "load_stalled"), client.reports
    assert message.startswith("stalled: no progress for 2"), message
    assert "(its launch); last health check: connection refused" in message, message
    wait_until(lambda: runtime.exit_code(t.id) == -1, 15, "the hung container removed")
