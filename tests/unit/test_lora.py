"""LoRA adapters' pure rules (core/lora.py) and the recipe's flags for them."""

from __future__ import annotations

import pytest

from heteroflow.core.engines import ENGINES, LaunchShape, build_command
from heteroflow.core.engines.flags import accepted_flags
from heteroflow.core.lora import (
    MAX_LORAS,
    Adapter,
    SyncPlan,
    adapter_path_refusal,
    adapters_of,
    engine_path,
    lora_args,
    lora_refusal,
    plan_sync,
    retry_delay_s,
)
from heteroflow.core.paths import VolumeRule

RULES = [VolumeRule(("/models", "/srv/lora"), ("/srv/lora/secret",))]


def shape(**over: object) -> LaunchShape:
    base: dict[str, object] = {"engine": "vllm", "model_path": "/models/m",
                               "served_model_name": "m", "port": 8000}
    return LaunchShape(**{**base, **over})  # type: ignore[arg-type]


def test_the_recipe_turns_lora_on_only_with_slots() -> None:
    off = build_command(shape())
    assert "--enable-lora" not in off.args and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in off.env
    on = build_command(shape(max_loras=3))
    at = on.args.index("--enable-lora")
    assert on.args[at:at + 3] == ("--enable-lora", "--max-loras", "3")
    assert on.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # the process runtime (vLLM's CPU build) gets the same flags
    cpu = build_command(shape(max_loras=2, gpus=0, runtime="process"))
    assert "--enable-lora" in cpu.args and cpu.env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    # each flag is one vLLM's own CLI takes (the pinned flag list)
    assert {"--enable-lora", "--max-loras"} <= accepted_flags("vllm")


def refuse(
    n: int, engine: str = "vllm", runtime_lora: bool = True, task_type: str = "inference",
    command: bool = False,
) -> str | None:
    return lora_refusal(
        n, engine=engine, runtime_lora=runtime_lora, task_type=task_type, command=command
    )


def test_only_engines_that_load_at_runtime_take_slots() -> None:
    assert [n for n, s in ENGINES.items() if s.runtime_lora] == ["vllm"]
    assert refuse(0, runtime_lora=False) is None  # 0 is always fine
    assert refuse(MAX_LORAS) is None
    refusals = {
        "over": refuse(MAX_LORAS + 1),
        "engine": refuse(1, engine="llamacpp", runtime_lora=False),
        "unresolved": refuse(1, engine="", runtime_lora=False),
        "type": refuse(1, task_type="training"),
        "command": refuse(1, command=True),
    }
    assert all(refusals.values()), refusals
    assert "llamacpp" in str(refusals["engine"]) and "name it" in str(refusals["unresolved"])
    assert lora_args(0) == ((), {})


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("", "empty"),
        ("/etc/lora", "outside the allowed volume prefixes"),
        ("/srv/lora/secret/a", "denied volume prefix"),
        ("/srv/lora/../etc", "'..' segment"),
        ("https://hub/x", "URL"),
        ("~/lora", "'~'"),
    ],
)
def test_an_adapter_path_follows_the_model_path_rule(path: str, why: str) -> None:
    problem = adapter_path_refusal(path, RULES, "of every node you may use")
    assert problem is not None and why in problem, problem
    assert problem.startswith("path") or why == "empty"


def test_allowed_adapter_paths() -> None:
    assert adapter_path_refusal("/srv/lora/a", RULES, "x") is None
    assert adapter_path_refusal("loras/a", RULES, "x") is None  # under /data/models


def test_plan_sync_unloads_moved_and_gone_then_loads() -> None:
    a, b = Adapter("a", "/p/a"), Adapter("b", "/p/b")
    assert not plan_sync([a], {"a": "/p/a"})
    assert plan_sync([a, b], {}) == SyncPlan((), (a, b))
    assert plan_sync([], {"a": "/p/a"}) == SyncPlan(("a",), ())
    moved = Adapter("a", "/p/a2")
    assert plan_sync([moved], {"a": "/p/a"}) == SyncPlan(("a",), (moved,))


def test_engine_path_in_a_container_is_under_a_volume() -> None:
    vols = [("/srv", "/s"), ("/srv/lora", "/lora")]
    assert engine_path("/srv/lora/a", "docker", vols) == "/lora/a"  # the deepest volume
    assert engine_path("/srv/lora", "docker", vols) == "/lora"
    assert engine_path("/srv/other/a", "docker", vols) == "/s/other/a"
    assert engine_path("/srv2/a", "docker", vols) is None  # /srv2 is not inside /srv
    assert engine_path("/srv/lora/a", "process", []) == "/srv/lora/a"
    assert engine_path("loras/a", "process", []) == "/data/models/loras/a"


def test_retry_delay_doubles_up_to_its_cap() -> None:
    assert [retry_delay_s(n, 5, 60) for n in range(6)] == [0.0, 5, 10, 20, 40, 60]
    assert retry_delay_s(10_000, 5, 60) == 60


def test_adapters_of_reads_stored_and_wire_values() -> None:
    rows = [{"name": "a", "path": "/p"}, {"name": "", "path": "/x"}, {"name": 1},
            Adapter("b", "/q")]
    assert adapters_of(rows) == (Adapter("a", "/p"), Adapter("b", "/q"))
