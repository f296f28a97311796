"""A service's capabilities from its task rows (issue 15): launch argv, else engine_args
plus the builder's tool flags; running tasks merged; replaced ones ignored."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from heteroflow.cmd.tables import capabilities_line
from heteroflow.core.engines.capabilities import UNKNOWN
from heteroflow.db.tables import Task
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.capabilities import CapabilitiesRead
from heteroflow.services.serving.capabilities import of_tasks, task_args

pytestmark = pytest.mark.feature("M13")


def task(**kw: Any) -> Task:
    base: dict[str, Any] = {
        "engine": "llamacpp", "model_path": "", "launch_argv": [], "command": [],
        "engine_args": [], "status": "running", "replaced_by": "",
    }  # fmt: skip
    return Task(**{**base, **kw})


def test_launched_argv_wins_then_planned_args() -> None:
    launched = task(launch_argv=["x", "--embeddings"], engine_args=["-c", "1"])
    assert task_args(launched) == ["x", "--embeddings"]
    planned = task(engine="vllm", model_path="/m/Qwen/Qwen2.5-7B", engine_args=["--x"])
    tools = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    assert task_args(planned) == ["--x", *tools]


def test_group_capabilities_from_running_tasks(tmp_path: Path) -> None:
    plain = str(write_tiny_gguf(tmp_path / "tiny.gguf"))
    tools = str(write_tiny_gguf(tmp_path / "tiny-tools.gguf", tools=True))
    old = task(model_path=plain, launch_argv=["-m", plain])
    new = task(model_path=tools, launch_argv=["-m", tools, "--embeddings"])
    caps = of_tasks([old, new])  # a rolling update: present if any generation has it
    assert (caps.tools, caps.embeddings, caps.chat) == (True, True, True)
    assert of_tasks([old, task(model_path=tools, status="stopped")]).tools is False
    assert of_tasks([task(model_path=tools, replaced_by="t2")]) == UNKNOWN
    assert of_tasks([task(engine="", command=["sh"])]) == UNKNOWN


def test_shown_in_the_cli() -> None:
    caps = CapabilitiesRead(chat=True, tools=False, embeddings=True, context_length=2048,
                            embedding_dimensions=64).model_dump()  # fmt: skip
    line = capabilities_line(caps)
    assert line == "chat embeddings ctx=2048 dims=64; no: tools; unknown: vision json_schema"
    assert capabilities_line(None) == "-"
