"""A model the agent fetched into its cache (issue 29) has a known size in its load
window (D5): the launch's own allow-list rule holds for it, so its load has an expected
time and teaches the node's read rate — not "model size unknown here"."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.load_progress import model_size
from heteroflow.schemas.nodes import TaskAssignment

pytestmark = pytest.mark.feature("D5")


def task(path: Path, fetched: bool) -> TaskAssignment:
    t = TaskAssignment(
        id="t-1", group_id="g-1", name="svc-0", status="starting", task_type="inference",
        model_name="svc", model_path=str(path), image="", engine="llama.cpp", command=[],
        engine_args=[], env=[], ports=[], gpu_ids=[], gpu_required=0, memory_mb=0,
        health_check={},
    )
    return t.model_copy(update={"model_fetched": fetched})


def test_a_fetched_model_is_sized_like_the_launch_sees_it(tmp_path: Path) -> None:
    entry = tmp_path / "cache" / "url--host-tiny.gguf--00" / "tiny.gguf"
    entry.parent.mkdir(parents=True)
    entry.write_bytes(b"GGUF" + b"\0" * 4092)
    config = NodeConfig(allowed_volume_prefixes=(str(tmp_path / "models"),))
    assert model_size(task(entry, fetched=True), "process", config).bytes == 4096
    # the same path named by a user (not fetched) is outside the allow-list: unknown
    assert model_size(task(entry, fetched=False), "process", config).bytes is None
