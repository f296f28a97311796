"""D5 for real: a model that loads longer than the old fixed window is never killed while
it makes progress, and a load that hangs is stopped with a reason that says so.

The node's model disk is made slow for real (``heteroflow.testing.slow_disk``): the
node's models folder is a disk of its own (an ext4 image on a loop device), and the agent
— and so every engine it starts, its children — runs in a block-I/O cgroup that reads
that disk at 15 MB/s (the rest of the machine, the agent's own Python and the engine's
binary included, reads at full speed); the model is a 540 MB GGUF whose pages are
dropped from the page cache first, so the real llama.cpp engine reads every byte
through the limit and loads for about 35 s. Its health check is the old kind of window
made small (a 5 s start period, then three failures 0.5 s apart: it would have been
killed after about 7 s).
Then the disk dies (1 byte a second): an engine whose loader hangs reading its model,
reading nothing more, is stopped once nothing moved for the agent's
``load_stall_s`` (8 s here), its task failed with ``fault.load_stalled``.

Without root, a loop device or a block-I/O cgroup controller the module is skipped with
the reason (HETEROFLOW_REQUIRE_SLOW_DISK=1, set by .ci/run, turns that into a failure).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from heteroflow.testing.engine_image import cache_dir
from heteroflow.testing.slow_disk import (
    LoopDisk,
    SlowDisk,
    SlowDiskUnavailable,
    drop_cache,
    write_big_gguf,
)

from .conftest import Stack, engine_pid, launch_stack, pid_gone, wait_for

pytestmark = pytest.mark.e2e

RATE = 15_000_000  # bytes a second: the 540 MB model loads for ~36 s
# the old-style window made small: killed after ~5 + 3 x 0.5 s had it still counted
CHECK = {"interval_seconds": 0.5, "start_period_seconds": 5, "unhealthy_threshold": 3}
OLD_WINDOW_S = 5 + 3 * 0.5


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, SlowDisk, Path]]:
    tmp = tmp_path_factory.mktemp("slowload")
    cached = write_big_gguf(cache_dir() / "models" / "slow-540mb.gguf", 540)
    with contextlib.ExitStack() as on_exit:
        try:
            # the stack's models folder (tmp/models) is this disk: the node's model volume
            models = on_exit.enter_context(LoopDisk(tmp / "models.img", tmp / "models", 1000))
            disk = on_exit.enter_context(SlowDisk(models.disk, RATE))
        except SlowDiskUnavailable as exc:
            if os.environ.get("HETEROFLOW_REQUIRE_SLOW_DISK") == "1":
                pytest.fail(f"a slow disk is required (HETEROFLOW_REQUIRE_SLOW_DISK=1): {exc}")
            pytest.skip(f"no slow disk here: {exc}")
        st = on_exit.enter_context(
            launch_stack(
                tmp,
                agent_prefix=disk.prefix(),
                agent_env={
                    "HETEROFLOW_AGENT_LOAD_STALL_S": "8",
                    "HETEROFLOW_AGENT_LOAD_SAMPLE_INTERVAL_S": "0.5",
                    "HETEROFLOW_AGENT_LOAD_REPORT_INTERVAL_S": "2",
                    "HETEROFLOW_AGENT_STOP_TIMEOUT_S": "3",
                },
            )
        )
        model = shutil.copyfile(cached, st.models_dir / "slow.gguf")
        yield st, disk, model


def create(st: Stack, name: str, model: Path) -> dict[str, Any]:
    body = {
        "name": name,
        "model_name": f"{name}-model",
        "health_check": dict(CHECK),
        "task": {
            "image": "ghcr.io/ggml-org/llama.cpp:server",
            "gpu_required": 0,
            "model_path": str(model),
            "memory_mb": 1024,
            "engine_args": ["-c", "512", "-np", "1"],
        },
    }
    r = st.api("POST", "/api/v1/task-groups", json=body)
    assert r.status_code == 201, r.text
    return dict(r.json())


def events(st: Stack, group_id: str) -> list[dict[str, Any]]:
    return list(st.api("GET", f"/api/v1/task-groups/{group_id}/events").json())


def delete(st: Stack, group_id: str) -> None:
    st.api("DELETE", f"/api/v1/task-groups/{group_id}")


@pytest.mark.feature("D5")
def test_a_slow_load_outlives_the_old_window_and_says_how_far_it_is(
    slow: tuple[Stack, SlowDisk, Path],
) -> None:
    st, _, model = slow
    drop_cache(model)
    size_mb = model.stat().st_size // 1_000_000
    began = time.monotonic()
    g = create(st, "slowload", model)
    seen: list[str] = []
    pids: set[int] = set()

    def running() -> dict[str, Any] | None:
        group = st.group(g["id"])
        [t] = group["tasks"]  # one task all along: never failed, never rebuilt
        assert t["status"] != "failed", f"{t}\n{st.logs()}"
        if t["status_message"] and (not seen or seen[-1] != t["status_message"]):
            seen.append(t["status_message"])
        port = (t.get("ports") or [{}])[0].get("host_port")
        if port and (pid := engine_pid(int(port))) is not None:
            pids.add(pid)
        return t if t["status"] == "running" else None

    t = wait_for(running, 85, "the slow load to become running", 0.25)
    took = time.monotonic() - began
    assert took > 3 * OLD_WINDOW_S, f"the load was not slow ({took:.0f} s): {seen}"
    assert len(pids) == 1, f"the engine was started more than once: {pids}"
    # the status said how far it was, and it kept moving
    progress = [m for m in seen if m.startswith("loading: ")]
    read = [int(m.group(1)) for p in progress if (m := re.match(r"loading: (\d+) of", p))]
    assert len(read) >= 3 and read == sorted(read) and read[-1] > read[0], seen
    assert all(f" of {size_mb} MB" in p for p in progress), seen
    assert t["status_message"].startswith("health check passed; loaded in"), t
    assert "MB read at" in t["status_message"], t
    timeline = events(st, g["id"])
    [opened] = [e for e in timeline if e["kind"] == "task.loading"]
    assert opened["message"].startswith(f"loading a {size_mb} MB model: expected ~"), opened
    assert not [e for e in timeline if e["kind"].startswith("fault.")], timeline
    delete(st, g["id"])


@pytest.mark.feature("D5")
def test_a_hung_load_is_stopped_with_the_stall_reason(
    slow: tuple[Stack, SlowDisk, Path],
) -> None:
    st, disk, _ = slow
    # a model larger than what a throttle lets through at once (about 1 MB), in a hidden
    # folder the node's model scan does not walk (its reads of it would hang too)
    hung = write_big_gguf(st.models_dir / ".dead" / "hung.gguf", 60)
    disk.set_rate(1)  # the disk dies: a read of the model never comes back
    group_id = ""
    try:
        drop_cache(hung)
        group_id = create(st, "hungload", hung)["id"]
        engines: dict[str, int] = {}  # task id -> its engine's pid

        def stalled() -> dict[str, Any] | None:
            for t in st.group(group_id)["tasks"]:
                port = (t.get("ports") or [{}])[0].get("host_port")
                if port and t["id"] not in engines and (pid := engine_pid(int(port))):
                    engines[t["id"]] = pid
            found = [e for e in events(st, group_id) if e["kind"] == "fault.load_stalled"]
            return found[0] if found else None

        began = time.monotonic()
        try:
            fault = wait_for(stalled, 60, "the hung load to be stopped", 0.25)
        except AssertionError as exc:  # say where it got to
            tasks = [(t["status"], t["status_message"]) for t in st.group(group_id)["tasks"]]
            kinds = [(e["kind"], e["message"]) for e in events(st, group_id)]
            raise AssertionError(f"{exc}\ntasks: {tasks}\nevents: {kinds}\n{st.logs()}") from None
        took = time.monotonic() - began
        assert took >= 8, f"stopped before load_stall_s ({took:.1f} s)"
        assert "stalled: no progress for" in fault["message"], fault
        assert "(its launch); last health check:" in fault["message"], fault
        task = st.api("GET", f"/api/v1/tasks/{fault['task_id']}").json()
        assert task["status"] == "failed" and task["status_message"].startswith("stalled: ")
        pid = engines.get(fault["task_id"])
        assert pid is not None, "the hung engine was never seen running"
        # stopped, although its loader hung reading a dead disk
        wait_for(lambda: pid_gone(pid), 20, f"engine {pid} to be gone")
    finally:
        if group_id:
            delete(st, group_id)
        disk.set_rate(RATE)
