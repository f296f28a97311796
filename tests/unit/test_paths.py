"""File request paths (C7): form, segment-boundary containment, symlink escapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from heteroflow.agent.file_requests import Refused, resolve_target
from heteroflow.core.paths import inside, task_roots, validate_target

pytestmark = pytest.mark.feature("C7")


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "empty"),
        ("models/x.gguf", "absolute"),
        ("./x", "absolute"),
        ("/data/models/../etc/passwd", "'..'"),
        ("/data/models/x/..", "'..'"),
        ("/data/models/a\x00b", "NUL"),
        ("/" + "a" * 4096, "4096 bytes"),
        ("/" + "é" * 2048, "4096 bytes"),  # 4097 bytes in UTF-8, 2049 characters
    ],
)
def test_bad_forms_are_refused_with_the_reason(path: str, why: str) -> None:
    reason = validate_target(path)
    assert reason is not None and why in reason


def test_good_forms_pass() -> None:
    assert validate_target("/data/models/x.gguf") is None
    assert validate_target("/data/models/..x/...") is None  # names, not '..' segments
    assert validate_target("/" + "a" * 4095) is None  # exactly 4096 bytes


def test_inside_is_decided_on_segment_boundaries() -> None:
    roots = ["/data/models"]
    assert inside("/data/models", roots)
    assert inside("/data/models/", roots)
    assert inside("/data/models/qwen/config.json", roots)
    assert inside("//data//models/x", roots)
    assert not inside("/data/models2/x", roots)
    assert not inside("/data/model", roots)
    assert not inside("/data", roots)
    assert not inside("/data/models/x", [])
    assert not inside("/data/models/x", ["data/models"])  # relative roots never match
    assert inside("/anything", ["/"])


def test_task_roots_process_is_the_model_files_folder_containers_the_mounts() -> None:
    assert task_roots("/m/tiny/model.gguf", "llamacpp", "process") == ["/m/tiny"]
    assert task_roots("tiny.gguf", "llamacpp", "process") == ["/data/models"]
    assert task_roots("/m/qwen", "vllm", "docker") == ["/m/qwen"]
    assert task_roots("qwen", "vllm", "docker") == ["/data/models/qwen"]
    assert task_roots("", "vllm", "docker") == []


def test_agent_refuses_symlink_escapes_after_realpath(tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "model.gguf").write_bytes(b"GGUF")
    secret = tmp_path / "secret.txt"
    secret.write_text("no")
    os.symlink(secret, root / "link.txt")
    os.symlink(tmp_path, root / "up")
    sibling = tmp_path / "models2"
    sibling.mkdir()
    (sibling / "x").write_text("x")

    assert resolve_target(str(root / "model.gguf"), [str(root)]) == str(root / "model.gguf")
    for bad in (
        root / "link.txt",
        root / "up" / "secret.txt",
        sibling / "x",
    ):
        with pytest.raises(Refused):
            resolve_target(str(bad), [str(root)])
    for bad_form in (f"{root}/../secret.txt", "relative/x", f"{root}/a\x00"):
        with pytest.raises(Refused):
            resolve_target(bad_form, [str(root)])
    with pytest.raises(Refused, match="not running"):
        resolve_target(str(root / "model.gguf"), [])


def test_a_root_that_is_itself_a_symlink_still_serves_its_files(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "f").write_text("x")
    os.symlink(real, tmp_path / "alias")
    assert resolve_target(str(tmp_path / "alias" / "f"), [str(tmp_path / "alias")]) == str(
        real / "f"
    )
