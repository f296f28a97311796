"""Issue 33 item 7: the dry run shows exactly what the runtime runs. It showed a memory
estimate for the model's trained context (32,768 tokens) while the process runtime ran
4,096, no estimate at all for a model named without a path, and a Gemma GGUF's chat
template was the launcher's secret. For each shape below — a model by path or by name,
with or without a context, a GGUF with or without its own template — the dry run's argv
is the agent's ``build_launch`` argv word for word, its estimate counts the context in
it, and a created service runs with the same."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.config import NodeConfig
from heteroflow.agent.launch import build_launch
from heteroflow.core.engine_access import ENGINE_ADDRESS
from heteroflow.core.engines.chat_templates import GEMMA_CHAT_TEMPLATE
from heteroflow.core.process_recipe import AGENT_PYTHON
from heteroflow.models.tiny_gguf import write_tiny_gguf
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.services.placement.dry_run import PLANNED_GROUP_ID, PLANNED_ID
from tests.gguf_files import header_gguf

from .conftest import Api
from .test_dry_run_matches_launch import masked
from .test_dry_run_process import IMAGE, heartbeat


def _gemma(path: Path) -> Path:
    """A Gemma 3 GGUF without a chat template (as the 270M model's), 4,096-token trained."""
    return header_gguf(path, "gemma3", blocks=2, heads=4, kv_heads=1, key_value_length=256,
                       embedding=640)


@pytest.mark.feature("C5")
@pytest.mark.parametrize(
    ("model", "by_name", "args", "ctx"),
    [
        ("gemma", True, [], 4096),  # the docs' example: a name, no -c
        ("gemma", False, ["-np", "2", "-c", "8192"], 8192),
        ("tiny", True, ["-c", "512"], 512),  # carries its own (ChatML) template
        ("gemma", False, ["--chat-template-file", "TEMPLATE"], 4096),
    ],
)
def test_the_dry_run_is_what_the_agent_starts(
    api: Api, tmp_path: Path, model: str, by_name: bool, args: list[str], ctx: int
) -> None:
    admin = api.login()
    heartbeat(api, tmp_path)
    path = _gemma(tmp_path / "g.gguf") if model == "gemma" else write_tiny_gguf(
        tmp_path / "t.gguf"
    )
    template = tmp_path / "own.jinja"
    template.write_text("{{ messages }}")
    args = [str(template) if a == "TEMPLATE" else a for a in args]
    named = path.stem if by_name else str(path)  # "g": found as g.gguf, as the agent looks
    request = {"name": "svc", "task": {"image": IMAGE, "gpu_required": 0, "engine": "llamacpp",
                                       "model_path": named, "engine_args": args}}
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=request, headers=admin)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert f"x {ctx} tokens" in (plan["estimate_detail"] or ""), plan["estimate_detail"]
    assert plan["memory_mb"] > 0
    (shown,) = plan["tasks"]
    argv = shown["container"]["command"]
    at = argv.index("-c") if "-c" in argv else argv.index("--ctx-size")
    assert argv[at + 1] == str(ctx)
    assert argv[argv.index("-m", 1 + argv.index("-m")) + 1] == str(path.resolve())
    wants_template = model == "gemma" and "--chat-template-file" not in args
    assert (GEMMA_CHAT_TEMPLATE in argv) == wants_template, argv

    g = api.client.post("/api/v1/task-groups", json=request, headers=admin)
    assert g.status_code == 201, g.text
    assert g.json()["tasks"][0]["memory_mb"] == plan["memory_mb"]
    assert api.app.scheduler.run_round().placed == 1
    (a,) = heartbeat(api, tmp_path)["tasks"]
    t = TaskAssignment.model_validate(a)
    config = NodeConfig.from_dict({"allowed_volume_prefixes": [str(tmp_path)]})
    spec = build_launch(t, config, cpu_threads=0, log_dir=tmp_path / "logs", host=ENGINE_ADDRESS)
    ids = {PLANNED_ID: t.id, PLANNED_GROUP_ID: t.group_id, AGENT_PYTHON: sys.executable}
    assert list(spec.argv) == masked(shown["container"], ids)["command"]


def test_a_cut_gguf_named_without_a_path_is_a_400(api: Api, tmp_path: Path) -> None:
    admin = api.login()
    heartbeat(api, tmp_path)
    whole = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(whole[:-4096])
    request = {"name": "svc", "task": {"image": IMAGE, "gpu_required": 0, "engine": "llamacpp",
                                       "model_path": "cut.gguf"}}
    r = api.client.post("/api/v1/task-groups", json=request, headers=admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "task.model_path"
    assert "is truncated" in r.json()["error"]["message"]


def test_a_name_whose_link_leads_out_of_the_prefix_is_not_read(
    api: Api, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name is found under a node's prefix only where its real path stays inside the
    node's rule: a link to a file outside is never opened by the server."""
    from heteroflow.models.estimate import estimate_model_path as real
    from heteroflow.services.placement import model_files

    opened: list[Path] = []

    def spy(path: Path, **kw: Any) -> Any:
        opened.append(path)
        return real(path, **kw)

    monkeypatch.setattr(model_files, "estimate_model_path", spy)
    admin = api.login()
    inside = tmp_path / "inside"
    inside.mkdir()
    heartbeat(api, inside)
    secret = write_tiny_gguf(tmp_path / "outside" / "secret.gguf")
    (inside / "link.gguf").symlink_to(secret)
    request = {"name": "svc", "task": {"image": IMAGE, "gpu_required": 0, "engine": "llamacpp",
                                       "model_path": "link.gguf"}}
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=request, headers=admin)
    assert r.status_code == 200, r.text
    assert opened == [] and r.json()["estimate_detail"] is None
