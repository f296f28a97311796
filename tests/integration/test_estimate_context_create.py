"""Creating a service sizes its memory estimate for the context its engine runs with."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gguf_files import header_gguf

from .conftest import Api, service_body


def _model(path: Path) -> Path:
    """A header-only Qwen2-0.5B-like GGUF trained for 32768 tokens (12 KiB of KV a token)."""
    return header_gguf(path, "qwen2", blocks=24, heads=14, kv_heads=2, embedding=896)


@pytest.mark.feature("B8")
def test_c_4096_gives_a_smaller_estimate_than_the_models_own_context(
    api: Api, tmp_path: Path
) -> None:
    admin = api.login()
    api.heartbeat()  # allows tmp_path (C4)
    model = str(_model(tmp_path / "qwen.gguf"))
    made = {}
    for name, args in (("plain", ["-np", "2", "-c", "0"]), ("short", ["-np", "2", "-c", "4096"])):
        r = api.client.post(
            "/api/v1/task-groups",
            json=service_body(name=name, task={"model_path": model, "engine_args": args}),
            headers=admin,
        )
        assert r.status_code == 201, r.text
        made[name] = r.json()["tasks"][0]
    plain, short = made["plain"], made["short"]
    assert (
        "x 32768 tokens = 384.0 MiB (ctx 32768 from -c 0: the model's trained length)"
        in (plain["estimate_detail"])
    )
    assert "x 4096 tokens = 48.0 MiB (ctx 4096 from -c)" in short["estimate_detail"]
    # a CPU service books the estimate as its memory: the KV difference, 336 MiB
    assert plain["memory_mb"] - short["memory_mb"] == 384 - 48


@pytest.mark.feature("B8")
def test_no_context_is_the_one_the_engine_is_started_with(api: Api, tmp_path: Path) -> None:
    """Issue 33: with no -c the estimate said 32,768 tokens (the trained length) while the
    process runtime ran 4,096; the platform now passes -c 4096 itself, on every runtime,
    and the estimate and the dry run's command say so."""
    admin = api.login()
    api.heartbeat()
    model = str(_model(tmp_path / "qwen.gguf"))
    body = service_body(name="bare", task={"model_path": model, "engine_args": ["-np", "2"]})
    r = api.client.post("/api/v1/task-groups?dry_run=true", json=body, headers=admin)
    assert r.status_code == 200, r.text
    plan = r.json()
    assert (
        "x 4096 tokens = 48.0 MiB (ctx 4096 from HeteroFlow's default -c)"
        in (plan["estimate_detail"])
    )
    command = plan["tasks"][0]["container"]["command"]
    at = command.index("-c")
    assert command[at + 1] == "4096" and command.count("-c") == 1, command
