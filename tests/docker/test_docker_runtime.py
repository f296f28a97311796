"""DockerRuntime against a real Docker Engine: labels, ports, mounts, GPU arguments, states."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import httpx
import pytest

from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.agent.runtime.protocol import LaunchFailed, PortInUse
from heteroflow.core.containers import GpuRequest, Mount, gpu_request, shared_memory
from tests.conftest import free_port
from tests.docker.conftest import make_plan, new_task_id, wait_until

SLEEP = ("sleep", "300")


@pytest.mark.feature("C13")
def test_start_stop_remove_with_labels(runtime: DockerRuntime, busybox_image: str) -> None:
    plan = make_plan(busybox_image, SLEEP, labels={"heteroflow.task": "t1"}, env={"A": "1"})
    runtime.start(plan)
    attrs = runtime.inspect(plan.name)
    labels = attrs["Config"]["Labels"]
    assert labels["heteroflow.managed"] == "true"
    assert labels["heteroflow.node"] == "node-test"
    assert labels["heteroflow.agent"] == runtime.agent_id
    assert labels["heteroflow.task"] == "t1"
    assert "A=1" in attrs["Config"]["Env"]
    assert attrs["HostConfig"]["Init"] is True
    assert runtime.running() == [plan.name]
    assert runtime.managed() == {plan.name: "running"}
    assert runtime.exit_code(plan.name) is None
    runtime.stop(plan.name, timeout_s=5)
    assert runtime.exit_code(plan.name) == -1
    assert runtime.managed() == {}
    runtime.stop(plan.name, timeout_s=5)  # missing is fine
    runtime.remove(plan.name)


@pytest.mark.feature("C1", "C13")
def test_ports_published_on_loopback_only(runtime: DockerRuntime, busybox_image: str) -> None:
    port = free_port()
    command = ("sh", "-c", "mkdir -p /w && echo hello > /w/index.html && httpd -f -p 8000 -h /w")
    plan = make_plan(busybox_image, command, ports={8000: ("127.0.0.1", port)})
    runtime.start(plan)
    bindings = runtime.inspect(plan.name)["HostConfig"]["PortBindings"]
    assert bindings == {"8000/tcp": [{"HostIp": "127.0.0.1", "HostPort": str(port)}]}

    def fetch() -> str:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/index.html", timeout=1).text
        except httpx.HTTPError:
            return ""

    assert "hello" in wait_until(fetch, 10, "busybox httpd on the published port")


@pytest.mark.feature("C4")
def test_read_only_mount(runtime: DockerRuntime, busybox_image: str, tmp_path: Path) -> None:
    (tmp_path / "f").write_text("original")
    script = "cat /ro/f && if echo x > /ro/f; then exit 0; else exit 7; fi"
    plan = make_plan(busybox_image, ("sh", "-c", script), mounts=(Mount(str(tmp_path), "/ro"),))
    runtime.start(plan)
    assert wait_until(lambda: runtime.exit_code(plan.name), 10, "the write to fail") == 7
    assert (tmp_path / "f").read_text() == "original"
    assert "Read-only file system" in runtime.log_tail(plan.name, 5)
    mounts = runtime.inspect(plan.name)["Mounts"]
    assert [(m["Destination"], m["RW"]) for m in mounts] == [("/ro", False)]


@pytest.mark.feature("C5")
def test_tensor_parallel_plan_gets_its_own_ipc_and_16g_shm(
    runtime: DockerRuntime, busybox_image: str
) -> None:
    ipc, shm, network = shared_memory("tensor", 2)
    plan = make_plan(busybox_image, SLEEP, ipc_mode=ipc, shm_size=shm, network_mode=network)
    runtime.start(plan)
    host = runtime.inspect(plan.name)["HostConfig"]
    assert host["IpcMode"] != "host"  # never the host's IPC namespace (issue 10)
    assert host["ShmSize"] == 16 * 1024**3


@pytest.mark.feature("C5")
def test_pipeline_plan_gets_host_network(runtime: DockerRuntime, busybox_image: str) -> None:
    ipc, shm, network = shared_memory("pipeline", 1)
    plan = make_plan(
        busybox_image,
        SLEEP,
        ipc_mode=ipc,
        shm_size=shm,
        network_mode=network,
        ports={8000: ("127.0.0.1", free_port())},  # meaningless on the host network: dropped
    )
    runtime.start(plan)
    host = runtime.inspect(plan.name)["HostConfig"]
    assert host["NetworkMode"] == "host"
    assert host["IpcMode"] != "host"
    assert not host["PortBindings"]


@pytest.mark.feature("C1")
def test_nvidia_request_reaches_the_container(runtime: DockerRuntime, busybox_image: str) -> None:
    plan = make_plan(busybox_image, ("env",), gpu=gpu_request("nvidia", [1, 3]))
    runtime.start(plan)
    assert wait_until(lambda: runtime.exit_code(plan.name) == 0, 10, "env to exit")
    requests = runtime.inspect(plan.name)["HostConfig"]["DeviceRequests"]
    assert requests[0]["DeviceIDs"] == ["1", "3"]
    assert requests[0]["Capabilities"] == [["gpu"]]
    assert "NVIDIA_VISIBLE_DEVICES=1,3" in runtime.log_tail(plan.name, 100).splitlines()


@pytest.mark.feature("C1")
def test_device_vendor_gets_devices_groups_and_env(
    runtime: DockerRuntime, busybox_image: str
) -> None:
    gpu = GpuRequest("amd", devices=("/dev/zero",), group_add=("video",), env={"HIP_X": "0"})
    plan = make_plan(busybox_image, ("sh", "-c", "env; id"), gpu=gpu)
    runtime.start(plan)
    assert wait_until(lambda: runtime.exit_code(plan.name) == 0, 10, "sh to exit")
    host = runtime.inspect(plan.name)["HostConfig"]
    assert host["Devices"] == [
        {"PathOnHost": "/dev/zero", "PathInContainer": "/dev/zero", "CgroupPermissions": "rwm"}
    ]
    assert host["GroupAdd"] == ["video"]
    out = runtime.log_tail(plan.name, 100)
    assert "HIP_X=0" in out.splitlines()
    assert "44(video)" in out


@pytest.mark.feature("C13")
def test_exit_code_and_removed_behind_its_back(
    runtime: DockerRuntime, busybox_image: str, docker_client: Any
) -> None:
    done = make_plan(busybox_image, ("sh", "-c", "exit 3"))
    runtime.start(done)
    wait_until(lambda: runtime.exit_code(done.name) is not None, 10, "the exit")
    assert runtime.exit_code(done.name) == 3
    assert runtime.managed()[done.name] == "exited"
    assert done.name not in runtime.running()
    runtime.stop(done.name, timeout_s=1)  # stopping an exited container removes it
    assert runtime.exit_code(done.name) == -1
    gone = make_plan(busybox_image, SLEEP)
    runtime.start(gone)
    docker_client.api.remove_container(gone.name, force=True)
    assert runtime.exit_code(gone.name) == -1
    assert runtime.log_tail(gone.name, 10) == ""


@pytest.mark.feature("C8")
def test_foreign_containers_are_never_listed_or_touched(
    runtime: DockerRuntime, busybox_image: str, docker_client: Any
) -> None:
    ours = make_plan(busybox_image, SLEEP)
    runtime.start(ours)
    plain = new_task_id()
    other_agent = new_task_id()
    docker_client.containers.run(busybox_image, list(SLEEP), name=plain, detach=True, init=True)
    docker_client.containers.run(
        busybox_image,
        list(SLEEP),
        name=other_agent,
        detach=True,
        init=True,
        labels={"heteroflow.managed": "true", "heteroflow.agent": "someone-else"},
    )
    try:
        assert runtime.running() == [ours.name]
        assert list(runtime.managed()) == [ours.name]
        for name in (plain, other_agent):
            assert runtime.exit_code(name) == -1
            assert runtime.inspect(name) == {}
            runtime.remove(name)
            runtime.stop(name, timeout_s=1)
            assert docker_client.containers.get(name).status == "running"
    finally:
        for name in (plain, other_agent):
            docker_client.api.remove_container(name, force=True)


@pytest.mark.feature("C8")
@pytest.mark.parametrize("name", ["nginx", "task-XYZ", "task-0123456789ab-x", "task-0123"])
def test_invalid_names_refused(
    runtime: DockerRuntime, busybox_image: str, docker_client: Any, name: str
) -> None:
    with pytest.raises(ValueError, match="task-<12 hex>"):
        runtime.start(make_plan(busybox_image, SLEEP, name=name))
    for call in (runtime.exit_code, runtime.remove, runtime.inspect):
        with pytest.raises(ValueError):
            call(name)
    assert docker_client.containers.list(all=True, filters={"name": name}) == []


@pytest.mark.feature("C11")
def test_port_conflict_raises_port_in_use(runtime: DockerRuntime, busybox_image: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        plan = make_plan(busybox_image, SLEEP, ports={8000: ("127.0.0.1", port)})
        with pytest.raises(PortInUse, match=str(port)):
            runtime.start(plan)
    assert runtime.managed() == {}  # the created container was removed again
    runtime.start(plan)  # and the same task can start once the port is free
    assert runtime.running() == [plan.name]
    second = make_plan(busybox_image, SLEEP, ports={8000: ("127.0.0.1", port)})
    with pytest.raises(PortInUse, match="already allocated"):
        runtime.start(second)


@pytest.mark.feature("C9")
def test_an_image_gone_after_its_pull_fails_the_start_with_that_reason(
    runtime: DockerRuntime,
) -> None:
    # the launcher pulls first (H7, tests/docker/test_registry_pull.py); start() meets a
    # missing image only when it went away in between (a prune)
    plan = make_plan("heteroflow-test/absent:1", SLEEP)
    with pytest.raises(LaunchFailed, match="pulls it again") as info:
        runtime.start(plan)
    assert "not present on this node" in str(info.value)
    assert runtime.managed() == {}


@pytest.mark.feature("C6")
def test_logs_since_ships_each_line_once(runtime: DockerRuntime, busybox_image: str) -> None:
    script = "echo a; echo b >&2; sleep 0.5; echo c; sleep 300"
    plan = make_plan(busybox_image, ("sh", "-c", script))
    runtime.start(plan)
    text, since = wait_until(
        lambda: (r := runtime.logs_since(plan.name, None))[0].count("\n") >= 2 and r,
        10,
        "the first lines",
    )
    assert sorted(text.splitlines()) == ["a", "b"]  # stdout and stderr: no order between them
    shipped = text

    def more() -> bool:
        nonlocal since, shipped
        chunk, since = runtime.logs_since(plan.name, since)
        shipped += chunk
        return "c" in chunk

    wait_until(more, 10, "the third line")
    assert sorted(shipped.splitlines()) == ["a", "b", "c"]
    assert runtime.logs_since(plan.name, since) == ("", since)
    assert runtime.logs_since(plan.name, None, tail=1)[0] == "c\n"
