"""``heteroflow services create --volume … --not-preemptible`` (A2): the request it sends."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from heteroflow import cli

from .test_cli import Recorder, server  # noqa: F401 - a fixture


@pytest.mark.feature("A2")
def test_create_sends_volumes_read_only_unless_rw_and_the_preemption_flag(
    server: Callable[..., Recorder],  # noqa: F811
) -> None:
    rec = server((201, {"id": "tg-1", "endpoint": "ep-1"}))
    argv = ["services", "create", "--name", "s", "--image", "vllm/vllm-openai:v0.11.2",
            "--model-path", "qwen", "--volume", "/data/loras:/mnt/loras",
            "--volume", "/data/hf:/root/.cache/huggingface:rw", "--not-preemptible",
            "--no-wait"]
    assert cli.main(argv) == 0
    (_, path, body) = rec.requests[0]
    assert path == "/api/v1/task-groups"
    assert body["task"]["volumes"] == [
        {"host_path": "/data/loras", "container_path": "/mnt/loras", "read_only": True},
        {"host_path": "/data/hf", "container_path": "/root/.cache/huggingface",
         "read_only": False},
    ]
    assert body["task"]["preemptible"] is False


@pytest.mark.parametrize("bad", ["/a", "/a:/b:rx", ":/b", "/a:/b:ro:x"])
def test_a_volume_the_cli_cannot_read_exits_2_naming_the_form(
    bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["services", "create", "--name", "s", "--volume", bad])
    assert exc.value.code == 2
    assert "HOST:CONTAINER" in capsys.readouterr().err
