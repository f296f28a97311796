"""A task's container is the trust boundary (issue 10): what a tenant member's command
can do inside it, tried from inside, on a real Docker Engine."""

from __future__ import annotations

import pytest

from heteroflow.agent.runtime.docker import DockerRuntime
from heteroflow.core.containers import HARDENED
from tests.docker.conftest import make_plan, wait_until

# Linux capability numbers (include/uapi/linux/capability.h)
CAP_BITS = {
    "CHOWN": 0,
    "DAC_OVERRIDE": 1,
    "FOWNER": 3,
    "SETGID": 6,
    "SETUID": 7,
    "NET_RAW": 13,
    "SYS_ADMIN": 21,
    "SYS_PTRACE": 19,
}


def run_script(runtime: DockerRuntime, image: str, script: str) -> tuple[int, str]:
    plan = make_plan(image, ("sh", "-c", script))
    runtime.start(plan)
    wait_until(lambda: runtime.exit_code(plan.name) is not None, 20, "the script to exit")
    code = runtime.exit_code(plan.name)
    out = runtime.log_tail(plan.name, 50)
    runtime.remove(plan.name)
    assert code is not None
    return code, out


def test_the_container_is_not_privileged_and_keeps_few_capabilities(
    runtime: DockerRuntime, busybox_image: str
) -> None:
    plan = make_plan(busybox_image, ("sleep", "300"))
    runtime.start(plan)
    host = runtime.inspect(plan.name)["HostConfig"]
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"]
    assert sorted(host["CapAdd"]) == sorted(HARDENED.cap_add)
    assert "no-new-privileges:true" in host["SecurityOpt"]
    assert host["PidsLimit"] == HARDENED.pids_limit
    assert host["NetworkMode"] != "host" and host["IpcMode"] != "host"
    assert host["PidMode"] != "host"
    runtime.remove(plan.name)


def test_inside_the_container_the_capabilities_are_gone(
    runtime: DockerRuntime, busybox_image: str
) -> None:
    """Read from the kernel, not from Docker's word: the effective set and no_new_privs."""
    code, out = run_script(
        runtime, busybox_image, "grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status"
    )
    assert code == 0, out
    fields = dict(line.split(":\t", 1) for line in out.splitlines() if ":\t" in line)
    effective = int(fields["CapEff"].strip(), 16)
    bounding = int(fields["CapBnd"].strip(), 16)
    allowed = sum(1 << CAP_BITS[c] for c in HARDENED.cap_add)
    assert effective == allowed, hex(effective)
    assert bounding == allowed, hex(bounding)  # cannot be regained by any exec
    assert fields["NoNewPrivs"].strip() == "1"


@pytest.mark.parametrize(
    ("attempt", "what"),
    [
        ("mount -t tmpfs none /mnt", "mount a filesystem (CAP_SYS_ADMIN)"),
        ("mknod /tmp/sda b 8 0 && cat /tmp/sda", "make and read a block device"),
        ("ip link add dummy0 type dummy", "change the network (CAP_NET_ADMIN)"),
        ("echo 1 > /proc/sys/kernel/sysrq", "write a kernel setting"),
    ],
)
def test_a_hostile_command_cannot_reach_the_host(
    runtime: DockerRuntime, busybox_image: str, attempt: str, what: str
) -> None:
    code, out = run_script(runtime, busybox_image, f"{attempt} && echo ESCAPED")
    assert code != 0 and "ESCAPED" not in out, f"could {what}: {out}"
