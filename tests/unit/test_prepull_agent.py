"""The agent's side of a recreate's pre-pull (agent/prepull.py): asked by the server, it
pulls with the launch's own puller and answers per replica — pulled, failed (tried again
after RETRY_S), unavailable (not found / unauthorised) — with the login the ask carried."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from heteroflow.agent.prepull import RETRY_S, Prepulls
from heteroflow.agent.runtime.protocol import PullFailed
from heteroflow.core.clock import FakeClock
from heteroflow.core.images import PullFailure, PullProgress
from heteroflow.schemas.nodes import TaskAssignment
from heteroflow.schemas.prepull import PrepullAsk
from heteroflow.schemas.registry_credentials import RegistryAuth

NEW = "reg.example:5000/engine:v2"


def assignment(task_id: str) -> TaskAssignment:
    return TaskAssignment(
        id=task_id, group_id="tg-0123456789ab", name=task_id, status="running",
        task_type="inference", model_name="m", model_path="/m/tiny.gguf",
        image="reg.example:5000/engine:v1", engine="llamacpp", command=[], engine_args=[],
        env=[], ports=[], gpu_ids=[], gpu_required=0, memory_mb=0, health_check={},
    )


class Client:
    def __init__(self, asks: list[PrepullAsk]) -> None:
        self.asks = asks
        self.answers: list[tuple[str, str, str, str]] = []

    async def prepulls(self) -> list[PrepullAsk]:
        return list(self.asks)

    async def prepulled(self, task_id: str, image: str, outcome: str, message: str) -> None:
        self.answers.append((task_id, image, outcome, message))


class Puller:
    """A launcher that pulls (``PullsImages``): fails as told, per image."""

    def __init__(self, fail: dict[str, PullFailure] | None = None) -> None:
        self.fail = fail or {}
        self.pulled: list[tuple[str, str, RegistryAuth | None]] = []

    def prepare(self, t: TaskAssignment, progress: Callable[[PullProgress], None]) -> bool:
        self.pulled.append((t.id, t.image, t.registry_auth))
        kind = self.fail.get(t.image)
        if kind is not None:
            raise PullFailed(t.image, kind, "the registry said no")
        return True


def agent(client: Client, launcher: Any, tasks: list[str]) -> Any:
    return SimpleNamespace(
        client=client, launcher=launcher, clock=FakeClock(),
        local={tid: SimpleNamespace(task=assignment(tid)) for tid in tasks},
    )


def run(p: Prepulls, a: Any) -> None:
    async def go() -> None:
        await p.round(a)
        await p.wait()

    asyncio.run(go())


@pytest.mark.feature("J2", "H7")
def test_it_pulls_with_the_asks_login_and_answers_pulled() -> None:
    login = RegistryAuth(username="u", password="s3cret")
    client = Client([PrepullAsk(task_id="t-1", image=NEW, registry_auth=login)])
    puller = Puller()
    run(Prepulls(), agent(client, puller, ["t-1"]))
    assert puller.pulled == [("t-1", NEW, login)]
    ((tid, image, outcome, message),) = client.answers
    assert (tid, image, outcome) == ("t-1", NEW, "pulled") and "s3cret" not in message


@pytest.mark.feature("J2", "H7")
@pytest.mark.parametrize(("kind", "outcome"), [
    (PullFailure.NOT_FOUND, "unavailable"), (PullFailure.UNAUTHORISED, "unavailable"),
    (PullFailure.UNREACHABLE, "failed"), (PullFailure.TIMEOUT, "failed"),
])
def test_a_failed_pull_says_whether_it_may_heal(kind: PullFailure, outcome: str) -> None:
    client = Client([PrepullAsk(task_id="t-1", image=NEW)])
    run(Prepulls(), agent(client, Puller({NEW: kind}), ["t-1"]))
    ((_, _, said, message),) = client.answers
    assert said == outcome and kind.value.replace("_", " ") in message


def test_a_pull_that_may_heal_is_tried_again_after_a_pause() -> None:
    client = Client([PrepullAsk(task_id="t-1", image=NEW)])
    puller = Puller({NEW: PullFailure.UNREACHABLE})
    a = agent(client, puller, ["t-1"])
    p = Prepulls()
    run(p, a)
    run(p, a)  # asked again at once: not yet
    assert len(puller.pulled) == 1
    a.clock.advance(RETRY_S)
    puller.fail.clear()
    run(p, a)
    assert [o for _, _, o, _ in client.answers] == ["failed", "pulled"]


def test_a_runtime_that_pulls_nothing_has_every_image() -> None:
    client = Client([PrepullAsk(task_id="t-1", image=NEW)])
    run(Prepulls(), agent(client, object(), ["t-1"]))
    assert [o for _, _, o, _ in client.answers] == ["pulled"]
