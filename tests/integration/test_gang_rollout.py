"""A rolling update replaces a gang as a unit (issue 32, G3) against the real API.

The two stages of a vLLM ``pipeline`` group run under two in-process agents with the
real ``ProcessRuntime`` (cheap Python programs stand in for vLLM, as in
test_gang_sleep_wake.py); the update's driver (``app.rollouts``) advances round by round
on a fake clock. Proven: the new gang starts whole beside the old (both stages, one
placement, one rendezvous of its own), is switched in once every stage runs — only the
stage that serves drained — and the old gang stops whole; a new gang that fails is not
retried stage by stage: the update rolls back at once, the old gang never drained nor
stopped, and the new gang's stages are all stopped.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from heteroflow.agent.daemon import Agent
from heteroflow.agent.runtime.process import ProcessRuntime
from heteroflow.agent.runtime.protocol import LaunchSpec
from heteroflow.core.rollout import CANDIDATE
from heteroflow.db.tables import Task
from heteroflow.schemas.nodes import TaskAssignment

from .conftest import Api
from .test_gang_sleep_wake import Gang, StageLauncher, alive, body, make_agent
from .test_gang_sleep_wake import runtimes as runtimes

NEW_ARGS = ["--max-model-len", "128"]


class FailingLauncher(StageLauncher):
    """Rank 1 of the new generation exits at once (its command is broken)."""

    def launch(self, t: TaskAssignment) -> tuple[str, ...]:
        if t.rank == 1 and t.engine_args == NEW_ARGS:
            argv = (sys.executable, "-c", "import sys; sys.exit(3)")
            self.runtime.start(LaunchSpec(t.id, argv))
            return argv
        return super().launch(t)


def rows(api: Api, group_id: str) -> list[Task]:
    with api.app.db.session() as s:
        out = list(
            s.scalars(select(Task).where(Task.group_id == group_id).order_by(Task.created_at))
        )
        s.expunge_all()
    return out


def rollout(api: Api, admin: dict[str, str], group_id: str) -> tuple[str, str]:
    g = api.client.get(f"/api/v1/task-groups/{group_id}", headers=admin).json()
    return g["rolling_update_state"], g["rolling_update_message"] or ""


async def drive(gang: Gang, advance_s: float = 1.0) -> None:
    """One fake step: the clock moves, both agents beat and watch, the scheduler and
    the update's driver take a round."""
    gang.api.clock.advance(advance_s)
    gang.api.app.scheduler.run_round()
    await gang.tick()
    for a in gang.agents:
        await a.watch_once()
    gang.api.app.rollouts.drive_round()
    await asyncio.sleep(0.05)


async def start_gang(api: Api, agents: list[Agent], admin: dict[str, str]) -> Gang:
    gang = Gang(api, agents, admin)
    await gang.tick()
    r = api.client.post("/api/v1/task-groups", json=body(), headers=admin)
    assert r.status_code == 201, r.text
    gang.group_id = r.json()["id"]
    assert api.app.scheduler.run_round().placed == 2
    await gang.until("running")
    return gang


def put_update(gang: Gang) -> None:
    r = gang.api.client.put(
        f"/api/v1/task-groups/{gang.group_id}/update",
        json={"engine_args": NEW_ARGS, "strategy": "rolling"},
        headers=gang.admin,
    )
    assert r.status_code == 200, r.text
    assert "a new gang of 2 stage(s) beside the old" in r.json()["rolling_update_message"]


def on_two_agents(
    api: Api, tmp_path: Path, launchers: list[Any],
    scenario: Callable[[list[Agent]], Awaitable[None]],
) -> None:
    """``scenario`` with the two nodes' agents (gang-a, gang-b), their clients closed after."""
    agents = [
        make_agent(api, tmp_path, f"gang-{n}", la) for n, la in zip("ab", launchers, strict=True)
    ]

    async def run() -> None:
        try:
            await scenario(agents)
        finally:
            for a in agents:
                await a.client.aclose()

    asyncio.run(run())


@pytest.mark.feature("G3")
def test_a_rolling_update_starts_the_new_gang_whole_then_stops_the_old_one(
    api: Api, tmp_path: Path, runtimes: list[ProcessRuntime]
) -> None:
    admin = api.login()
    launchers = [StageLauncher(rt) for rt in runtimes]

    async def scenario(agents: list[Agent]) -> None:
        gang = await start_gang(api, agents, admin)
        olds = {t.rank: t for t in rows(api, gang.group_id)}
        old_pids = [rt.pid(o.id) for o in olds.values() for rt in runtimes if rt.pid(o.id)]
        assert len(old_pids) == 2 and all(alive(p) for p in old_pids)
        put_update(gang)
        seen_both_gangs = False
        deadline = time.monotonic() + 60
        while rollout(api, admin, gang.group_id)[0] != "done":
            assert time.monotonic() < deadline, rollout(api, admin, gang.group_id)
            await drive(gang, 2.0)
            now = rows(api, gang.group_id)
            cands = [t for t in now if t.replaced_by == CANDIDATE]
            if len(cands) == 2 and {c.status for c in cands} == {"running"}:
                # the new gang runs whole beside the old, which still serves
                assert {olds[r].id for r in (0, 1)} <= {
                    t.id for t in now if t.status == "running" and t.replaced_by == ""
                }
                seen_both_gangs = True
            # only the stage that serves is drained; the headless one never is
            assert not any(t.draining for t in now if t.rank == 1)
        assert seen_both_gangs
        now = rows(api, gang.group_id)
        current = sorted((t for t in now if t.replaced_by == ""), key=lambda t: t.rank)
        assert [(t.rank, t.generation, t.status) for t in current] == [
            (0, 2, "running"),
            (1, 2, "running"),
        ]
        assert all(t.engine_args == NEW_ARGS for t in current)
        # one placement and one rendezvous for the new gang, the same on both stages
        gangs = [a.local[t.id].task.gang for t in current for a in agents if t.id in a.local]
        assert len(gangs) == 2 and gangs[0] is not None and gangs[1] is not None
        assert (gangs[0]["master_addr"], gangs[0]["master_port"]) == (
            gangs[1]["master_addr"],
            gangs[1]["master_port"],
        )
        # the old gang stopped whole, replaced rank by rank by the new one
        for rank, old in olds.items():
            was = next(t for t in now if t.id == old.id)
            assert was.replaced_by == current[rank].id
            assert was.status in ("stopping", "stopped")
        for _ in range(3):
            await drive(gang)
        assert {
            next(t for t in rows(api, gang.group_id) if t.id == o.id).status
            for o in olds.values()
        } == {"stopped"}
        assert not any(alive(p) for p in old_pids), "an old stage kept running"

    on_two_agents(api, tmp_path, launchers, scenario)


@pytest.mark.feature("G3")
def test_a_new_gang_that_fails_rolls_back_at_once_and_the_old_gang_serves_on(
    api: Api, tmp_path: Path, runtimes: list[ProcessRuntime]
) -> None:
    admin = api.login()
    launchers = [FailingLauncher(rt) for rt in runtimes]

    async def scenario(agents: list[Agent]) -> None:
        gang = await start_gang(api, agents, admin)
        olds = {t.id for t in rows(api, gang.group_id)}
        put_update(gang)
        deadline = time.monotonic() + 60
        while rollout(api, admin, gang.group_id)[0] != "failed":
            assert time.monotonic() < deadline, rollout(api, admin, gang.group_id)
            await drive(gang, 2.0)
            now = rows(api, gang.group_id)
            for t in now:  # the old gang serves throughout: never drained nor stopped
                if t.id in olds:
                    assert (t.status, t.draining, t.replaced_by) == ("running", False, "")
        _, message = rollout(api, admin, gang.group_id)
        assert "rolling back" in message or "rolled back" in message, message
        assert "failed 4 times" not in message and "exited" in message, message
        now = rows(api, gang.group_id)
        news = [t for t in now if t.id not in olds]
        assert len(news) == 2  # one attempt: no stage retried alone
        for _ in range(3):
            await drive(gang)
        news = [t for t in rows(api, gang.group_id) if t.id not in olds]
        assert {t.status for t in news} <= {"stopped", "failed"}, [
            (t.rank, t.status) for t in news
        ]
        assert gang.statuses() == ["running", "running"]

    on_two_agents(api, tmp_path, launchers, scenario)


@pytest.mark.feature("G3")
def test_a_recreate_stops_the_old_gang_whole_then_starts_the_new_one_whole(
    api: Api, tmp_path: Path, runtimes: list[ProcessRuntime]
) -> None:
    admin = api.login()
    launchers = [StageLauncher(rt) for rt in runtimes]

    async def scenario(agents: list[Agent]) -> None:
        gang = await start_gang(api, agents, admin)
        olds = {t.id for t in rows(api, gang.group_id)}
        r = api.client.put(
            f"/api/v1/task-groups/{gang.group_id}/update",
            json={"engine_args": NEW_ARGS, "strategy": "recreate"},
            headers=admin,
        )
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 60
        while rollout(api, admin, gang.group_id)[0] != "done":
            assert time.monotonic() < deadline, rollout(api, admin, gang.group_id)
            await drive(gang, 2.0)
            now = rows(api, gang.group_id)
            assert not any(t.draining for t in now if t.rank == 1)
            live_old = [t for t in now if t.id in olds and t.status == "running"]
            live_new = [t for t in now if t.id not in olds and t.status == "running"]
            assert not (live_old and live_new), "two generations of a gang ran together"
        current = sorted(
            (t for t in rows(api, gang.group_id) if t.replaced_by == ""),
            key=lambda t: t.rank,
        )
        assert [(t.generation, t.status) for t in current] == [(2, "running")] * 2

    on_two_agents(api, tmp_path, launchers, scenario)
