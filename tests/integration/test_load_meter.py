"""D5 on the node: what the agent reads of a loading engine (agent/load_progress.py).

A real child process under the process runtime: the bytes it reads from the disk (its
file dropped from the page cache first) and the CPU it burns are counted over its process
tree; the log mark moves only when the log says something new; the engine family's
words come through; and the model's size on the node is found for a GGUF, its split
siblings and a model folder.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.load_progress import (
    DockerMeter,
    EngineProgress,
    NoMeter,
    ProcessMeter,
    Usage,
    meter_for,
    model_size,
    weight_files,
)
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.testing.slow_disk import SlowDiskUnavailable, disk_of, drop_cache

TASK = "task-00000000d5d5"
# busy for about half a second, then read the file named, then wait to be stopped
CHILD = """
import sys, time
end = time.process_time() + 0.5
while time.process_time() < end:
    pass
with open(sys.argv[1], "rb") as f:
    while f.read(1 << 20):
        pass
print("read it", flush=True)
time.sleep(60)
"""


def assignment(**over: Any) -> TaskAssignment:
    fields: dict[str, Any] = {
        "id": TASK, "group_id": "tg-0123456789ab", "name": "svc-0", "status": "starting",
        "task_type": "inference", "model_name": "m", "model_path": "", "image": "img",
        "engine": "vllm", "command": [], "engine_args": [], "env": [], "ports": [],
        "gpu_ids": [], "gpu_required": 0, "memory_mb": 0, "health_check": {},
    }
    fields.update(over)
    return TaskAssignment(**fields)


@pytest.fixture
def runtime(tmp_path: Path) -> Iterator[ProcessRuntime]:
    rt = ProcessRuntime(tmp_path / "agent")
    try:
        yield rt
    finally:
        rt.stop(TASK, 5)


@pytest.mark.feature("D5")
def test_the_process_meter_counts_what_the_engine_reads_from_disk_and_its_cpu(
    tmp_path: Path, runtime: ProcessRuntime
) -> None:
    blob = tmp_path / "weights.bin"
    blob.write_bytes(b"\x5a" * (24 << 20))
    drop_cache(blob)
    meter = meter_for(runtime)
    assert isinstance(meter, ProcessMeter)
    assert meter.usage(TASK, None) == Usage()  # nothing runs under that id yet
    runtime.start(LaunchSpec(TASK, (sys.executable, "-c", CHILD, str(blob))))
    deadline = time.monotonic() + 30
    while "read it" not in runtime.log_tail(TASK, 5):
        assert time.monotonic() < deadline, runtime.log_tail(TASK, 20)
        time.sleep(0.05)
    used = meter.usage(TASK, None)
    assert used.cpu_s is not None and used.cpu_s >= 0.4, used
    try:
        disk_of(blob)
    except SlowDiskUnavailable:
        pytest.skip("the test's files are not on a block device (tmpfs): no bytes to count")
    assert used.read_bytes is not None and used.read_bytes >= 24 << 20, used


class Tail:
    """A runtime whose log tail the test writes."""

    name = "fake"

    def __init__(self) -> None:
        self.text = ""

    def log_tail(self, task_id: str, lines: int) -> str:
        return self.text


@pytest.mark.feature("D5")
def test_the_log_mark_moves_only_on_news_and_the_engines_words_come_through() -> None:
    logs = Tail()
    source = EngineProgress(logs, NoMeter())  # type: ignore[arg-type]
    t = assignment(engine="vllm")
    logs.text = "INFO Starting to load model /data/models/m..."
    first = source.sample(t, 1.0, "connection refused", None)
    assert first.fraction == 0.0 and not first.says_loading and first.read_bytes is None
    again = source.sample(t, 2.0, "connection refused", None)
    assert again.log_mark == first.log_mark  # the same tail: no news
    logs.text += "\nLoading safetensors checkpoint shards:  25% Completed | 1/4 [..]"
    news = source.sample(t, 3.0, "connection refused", None)
    assert news.log_mark != first.log_mark and news.fraction == 0.25
    llama = source.sample(assignment(engine="llamacpp"), 4.0, "HTTP 503: Loading model", None)
    assert llama.says_loading and llama.fraction is None


def test_the_models_size_on_the_node(tmp_path: Path) -> None:
    split = [tmp_path / f"big-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for i, f in enumerate(split):
        f.write_bytes(b"x" * (1000 * (i + 1)))
    (tmp_path / "other.gguf").write_bytes(b"y" * 10)
    assert weight_files(split[1]) == split
    hf = tmp_path / "hf"
    hf.mkdir()
    for name, size in (("model-1.safetensors", 300), ("model-2.safetensors", 200),
                       ("config.json", 50), ("tokenizer.json", 70)):
        (hf / name).write_bytes(b"z" * size)
    docker = model_size(assignment(model_path=str(hf)), "docker", NodeConfig())
    assert docker.bytes == 500
    rules = NodeConfig(allowed_volume_prefixes=(str(tmp_path),))
    process = model_size(assignment(model_path=str(split[0]), engine="llamacpp"), "process", rules)
    assert process.bytes == 6000
    assert model_size(assignment(model_path="org/hub-model"), "docker", NodeConfig()).bytes is None
    assert model_size(assignment(model_path=str(split[0])), "process", NodeConfig()).bytes is None


class StatsApi:
    """The Engine's stats call as docker-py makes it, recorded; cgroup v1 counters."""

    def __init__(self, version: str) -> None:
        self._version = version
        self.calls: list[dict[str, Any]] = []

    def stats(self, container: str, **kw: Any) -> dict[str, Any]:
        self.calls.append(kw)
        return {
            "cpu_stats": {"cpu_usage": {"total_usage": 2_500_000_000}},
            "blkio_stats": {"io_service_bytes_recursive": [
                {"major": 254, "minor": 0, "op": "Read", "value": 700},
                {"major": 254, "minor": 0, "op": "Write", "value": 5},
                {"major": 8, "minor": 0, "op": "Read", "value": 30},
            ]},
        }


class Client:
    def __init__(self, version: str) -> None:
        self.api = StatsApi(version)


def test_the_docker_meter_reads_the_models_disk_and_speaks_to_old_engines() -> None:
    new = DockerMeter(Client("1.45"))
    assert new.usage(TASK, "254:0") == Usage(700, 2.5)
    assert new.usage(TASK, "9:9") == Usage(730, 2.5)  # a disk it does not name: all reads
    assert new.client.api.calls[0] == {"stream": False, "one_shot": True}
    old = DockerMeter(Client("1.40"))  # no one-shot stats before API 1.41
    assert old.usage(TASK, None) == Usage(730, 2.5)
    assert old.client.api.calls == [{"stream": False}]
