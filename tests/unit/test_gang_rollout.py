"""The rollout machine for a gang (issue 32, G3): a pipeline's stages are replaced as a
unit — one batch, only the stage that serves drains, and a failed attempt rolls back at
once instead of retrying (``Progress.gang``). ``World`` is test_rollout.py's."""

from __future__ import annotations

from dataclasses import replace

import pytest

from heteroflow.core.rollout import (
    Progress,
    RolloutState,
    Step,
    Strategy,
    progress_from_json,
    progress_to_json,
)

from .test_rollout import World


class Gang(World):
    """A 2-stage gang: rank 0 serves, rank 1 runs headless (``Replica.serves``)."""

    def __init__(self, strategy: Strategy = Strategy.ROLLING) -> None:
        super().__init__(ranks=2, strategy=strategy, batch=2)
        self.p = replace(self.p, gang=True)
        self._headless()

    def apply(self, st: Step) -> None:
        super().apply(st)
        self._headless()

    def _headless(self) -> None:
        for tid, r in self.reps.items():
            self.reps[tid] = replace(r, serves=r.rank == 0)


@pytest.mark.feature("G3")
def test_the_new_gang_starts_whole_and_only_rank_0_of_the_old_one_drains() -> None:
    w = Gang()
    old0, old1 = (r.id for r in w.current())
    st = w.tick()
    assert [c.rank for c in st.create] == [0, 1]  # the whole new gang at once
    for tid in w.live_candidates():
        w.run(tid)
    w.tick()  # settling
    st = w.tick(2)
    assert st.drain == (old0,)  # the headless stage has no request to finish
    st = w.tick(30)  # the drain timeout (no gateway report)
    assert sorted(pr.rank for pr in st.promote) == [0, 1]  # switched as one
    assert {o for pr in st.promote for o in pr.olds} == {old0, old1}
    st = w.tick()
    assert st.state == RolloutState.DONE and w.gens() == [(0, 2), (1, 2)]


@pytest.mark.feature("G3")
def test_a_failed_stage_of_the_new_gang_rolls_back_at_once() -> None:
    w = Gang()
    w.tick()
    c0, c1 = w.live_candidates()
    w.run(c1)
    w.fail(c0, "engine exited with code 3")
    st = w.tick()
    assert st.state == RolloutState.ROLLING_BACK and not st.create  # no second attempt
    assert "attempt 1 of 4 failed" not in st.message and "code 3" in st.message
    assert st.stop == (c1,)  # the running headless stage stops now: nothing to drain
    assert not w.p.retiring
    st = w.tick()
    assert st.state == RolloutState.FAILED
    assert w.gens() == [(0, 1), (1, 1)]  # the old gang serves on


@pytest.mark.feature("G3")
def test_a_running_rank_0_of_a_failed_new_gang_drains_before_it_stops() -> None:
    w = Gang()
    w.tick()
    c0, c1 = w.live_candidates()
    w.run(c0)  # routed once running: it may hold requests
    w.fail(c1)
    st = w.tick()
    assert st.state == RolloutState.ROLLING_BACK and c0 in w.p.retiring and c0 not in st.stop


def test_a_gangs_progress_survives_its_json() -> None:
    p = Progress(Strategy.ROLLING, generation=2, from_generation=1, batch_size=2, gang=True)
    assert progress_from_json(progress_to_json(p)).gang
    assert not progress_from_json({**progress_to_json(p), "gang": False}).gang
