"""model=auto (M10): the pure rule set, the prompt estimate and the capabilities header."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from heteroflow.gateway.routing.auto import (
    AutoChoice,
    NoAutoChoice,
    choose_model,
    estimate_prompt_tokens,
    parse_capabilities,
)
from heteroflow.schemas.routing import Backend, RouteTarget


def _route(name: str, *tags: str, backends: int = 1, draining: bool = False) -> RouteTarget:
    bs = tuple(
        Backend(f"{name}-{i}", f"http://{name}-{i}:8000", draining=draining)
        for i in range(backends)
    )
    return RouteTarget(f"r-{name}", f"g-{name}", 0, 100, bs, tags=tags)


ROUTES: dict[str, tuple[RouteTarget, ...]] = {
    "general": (_route("general"),),
    "coder": (_route("coder", "code"),),
    "coder-long": (_route("coder-long", "code", "long-context"),),
    "long": (_route("long", "long-context"),),
    "embedder": (_route("embedder", "embedding"),),
    "empty": (_route("empty", "code", backends=0),),
    "drained": (_route("drained", "code", "vision", draining=True),),
}


def _choose(
    routes: dict[str, tuple[RouteTarget, ...]] = ROUTES,
    *,
    embeddings: bool = False,
    capabilities: frozenset[str] = frozenset(),
    prompt_tokens: int = 10,
    loads: dict[str, float] | None = None,
) -> AutoChoice | NoAutoChoice:
    by_route = {ts[0].route_id: (loads or {}).get(m, 0.0) for m, ts in routes.items()}

    def load(targets: Sequence[RouteTarget]) -> float:
        return by_route[targets[0].route_id]

    return choose_model(
        routes,
        embeddings=embeddings,
        capabilities=capabilities,
        prompt_tokens=prompt_tokens,
        long_prompt_tokens=4096,
        load=load,
    )


@pytest.mark.feature("M10")
def test_least_loaded_chat_model_wins_and_ties_go_by_name() -> None:
    choice = _choose()
    assert isinstance(choice, AutoChoice)
    assert choice.model == "coder"  # all idle: first name; never the embedding model
    choice = _choose(loads={"coder": 2.0, "coder-long": 1.0, "general": 0.5, "long": 3.0})
    assert isinstance(choice, AutoChoice) and choice.model == "general"
    assert choice.reason == "prompt~10 tokens; least loaded 0.5 of 4"


@pytest.mark.feature("M10")
def test_capabilities_are_required() -> None:
    choice = _choose(capabilities=frozenset({"code"}), loads={"coder": 1.0})
    assert isinstance(choice, AutoChoice) and choice.model == "coder-long"
    assert choice.reason.startswith("capabilities=code; ")
    # a drained or backend-less model is not a candidate, even when it alone matches
    missing = _choose(capabilities=frozenset({"code", "vision"}))
    assert isinstance(missing, NoAutoChoice)
    assert "'code,vision'" in missing.message


@pytest.mark.feature("M10")
def test_long_prompts_prefer_long_context_models() -> None:
    choice = _choose(prompt_tokens=5000, loads={"long": 9.0, "coder-long": 8.0})
    assert isinstance(choice, AutoChoice) and choice.model == "coder-long"
    assert "prompt~5000 tokens; >4096: long-context" in choice.reason
    # with no long-context model the rule steps aside instead of refusing
    short_only = {m: ROUTES[m] for m in ("general", "coder")}
    choice = _choose(short_only, prompt_tokens=5000)
    assert isinstance(choice, AutoChoice) and choice.model == "coder"
    assert "no long-context model" in choice.reason


@pytest.mark.feature("M10")
def test_embeddings_choose_only_embedding_models() -> None:
    choice = _choose(embeddings=True)
    assert isinstance(choice, AutoChoice) and choice.model == "embedder"
    no_embedder = {m: ts for m, ts in ROUTES.items() if m != "embedder"}
    assert isinstance(_choose(no_embedder, embeddings=True), NoAutoChoice)


@pytest.mark.feature("M10")
def test_nothing_routable_and_the_header_value() -> None:
    assert isinstance(_choose({"empty": ROUTES["empty"]}), NoAutoChoice)
    choice = AutoChoice("coder", "capabilities=code; prompt~3 tokens; least loaded 0.0 of 1")
    assert choice.header() == (
        b"x-heteroflow-auto-model",
        b"coder; reason=capabilities=code; prompt~3 tokens; least loaded 0.0 of 1",
    )


@pytest.mark.feature("M10")
def test_prompt_estimate_is_characters_over_four() -> None:
    chat = {
        "messages": [
            {"role": "system", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 40}, {"type": "image"}]},
        ]
    }
    assert estimate_prompt_tokens(chat) == 20
    assert estimate_prompt_tokens({"prompt": ["a" * 8, "b" * 8]}) == 4
    assert estimate_prompt_tokens({"input": "z" * 400}) == 100
    assert estimate_prompt_tokens({"prompt": [[1, 2, 3]], "messages": 7}) == 0


@pytest.mark.feature("M10")
def test_capabilities_header_parsing() -> None:
    assert parse_capabilities(None) == frozenset()
    assert parse_capabilities(b" Code , long-context,,") == {"code", "long-context"}
