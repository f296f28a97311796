"""A model source at create and dry run (issue 29, H9): resolved before anything is
placed — the dry run shows its files, size and revision; a source that does not resolve
is a 400 naming ``task.model_path`` with the reason, and nothing is written.

The hub is ``testing.model_hub``'s stand-in (no test machine reaches huggingface.co),
served on the loopback from its own thread and event loop, as a real hub would be.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import SecretStr

from heteroflow.db.tables import Task, TaskGroup
from heteroflow.testing.model_hub import COMMIT, ModelHub, Repo, serving
from tests.conftest import free_port

from .conftest import Api

pytestmark = pytest.mark.feature("H9")

TOKEN = "hf_platformTOKEN0123456789abcdef"
WEIGHTS = bytes(range(256)) * 16
CONFIG = b'{"model_type": "llama"}'


@pytest.fixture
def hub_url() -> Iterator[str]:
    hub = ModelHub(
        repos={
            "org/tiny": Repo({"config.json": CONFIG, "model.safetensors": WEIGHTS},
                             lfs=frozenset({"model.safetensors"})),
            "org/private": Repo({"config.json": CONFIG}, token=TOKEN),
        },
    )
    with serving(hub) as url:
        yield url


def body(model_path: str, engine: str = "vllm") -> dict[str, Any]:
    return {
        "name": "sourced",
        "model_name": "sourced",
        "task": {
            "image": "vllm/vllm-openai:v0.11.2", "engine": engine, "gpu_required": 1,
            "model_path": model_path,
        },
    }


def rows(api: Api) -> list[int]:
    with api.app.db.session() as s:
        return [s.query(TaskGroup).count(), s.query(Task).count()]


def test_the_dry_run_shows_what_the_source_names(api: Api, hub_url: str) -> None:
    api.app.settings.hf_endpoint = hub_url
    admin = api.login()
    r = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=body("hf://org/tiny"), headers=admin
    )
    assert r.status_code == 200, r.text
    src = r.json()["model_source"]
    assert (src["source"], src["kind"], src["revision"]) == ("hf://org/tiny@main", "hf", COMMIT)
    assert src["bytes"] == len(WEIGHTS) + len(CONFIG) and src["file_count"] == 2
    files = {f["path"]: f for f in src["files"]}
    assert files["model.safetensors"]["bytes"] == len(WEIGHTS)
    assert files["model.safetensors"]["sha256"]
    # a path is not a source
    plain = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=body("/data/models/x"), headers=admin
    )
    assert plain.status_code in (200, 400) and (plain.json().get("model_source") is None)


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("hf://org/missing", "not found"),
        ("hf://org/private", "unauthorized"),
    ],
)
def test_a_source_that_does_not_resolve_is_a_400_naming_the_field(
    api: Api, hub_url: str, source: str, reason: str
) -> None:
    api.app.settings.hf_endpoint = hub_url
    admin = api.login()
    for dry in ("true", "false"):
        r = api.client.post(
            f"/api/v1/task-groups?dry_run={dry}", json=body(source), headers=admin
        )
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["field"] == "task.model_path", err
        assert source.removeprefix("hf://") in err["message"], err
    assert rows(api) == [0, 0]


def test_the_platform_token_opens_a_private_repository(api: Api, hub_url: str) -> None:
    api.app.settings.hf_endpoint = hub_url
    api.app.settings.hub_token = SecretStr(TOKEN)
    admin = api.login()
    r = api.client.post(
        "/api/v1/task-groups?dry_run=true", json=body("hf://org/private"), headers=admin
    )
    assert r.status_code == 200, r.text
    assert r.json()["model_source"]["file_count"] == 1
    assert TOKEN not in r.text


def test_a_hub_that_does_not_answer_is_a_400_not_a_hang(api: Api) -> None:
    api.app.settings.hf_endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens
    admin = api.login()
    r = api.client.post("/api/v1/task-groups", json=body("hf://org/tiny"), headers=admin)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == "task.model_path"
    assert rows(api) == [0, 0]


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("fleet://m-1", "no node you may use holds fleet://m-1"),
        ("http://example.com/m.gguf", "only to a loopback host"),
        ("https://u:p@example.com/m.gguf", "user"),
    ],
)
def test_sources_refused_by_their_form_alone(api: Api, source: str, says: str) -> None:
    admin = api.login()
    r = api.client.post("/api/v1/task-groups", json=body(source), headers=admin)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"], r.json()


def test_llamacpp_takes_one_gguf_files_url_not_a_hub_repository(api: Api) -> None:
    admin = api.login()
    b = body("hf://org/tiny", engine="llamacpp")
    b["task"]["image"] = "ghcr.io/ggml-org/llama.cpp:server"
    r = api.client.post("/api/v1/task-groups", json=b, headers=admin)
    assert r.status_code == 400, r.text
    assert "loads one GGUF file: name its URL" in r.json()["error"]["message"]
