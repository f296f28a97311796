"""The rollout state machine (core/rollout/) on a fake clock: every branch — success,
a batch tried again, the rollback (and a restore that fails), recreate, the drain rule,
the lease (renew, expiry, the 16-minute bound), abandon (the expiry scan) and orphans.

``World`` applies each step to a dict of replicas the way services/lifecycle/rollout/ writes it
to the database (a created candidate is pending; a stop is immediate), so a test drives
the machine round by round and moves replicas (running, failed) by hand."""

from __future__ import annotations

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from heteroflow.core.events import EventKind
from heteroflow.core.rollout import (
    CANDIDATE,
    Progress,
    Replica,
    RolloutPolicy,
    RolloutState,
    Step,
    Strategy,
    abandon,
    drained,
    lease_action,
    orphans,
    progress_from_json,
    progress_to_json,
    step,
)
from heteroflow.core.states import TaskStatus as T

T0 = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = RolloutPolicy(
    ready_timeout_s=100, settle_s=2, drain_min_s=2, drain_timeout_s=30, batch_retries=3
)


class World:
    """Replicas, a clock and the machine, applying steps as the service does."""

    def __init__(
        self, ranks: int = 2, strategy: Strategy = Strategy.ROLLING, batch: int = 1,
        policy: RolloutPolicy = POLICY,
    ):
        self.now = T0
        self.policy = policy
        self.ids = (f"task-{i}" for i in itertools.count())
        self.reps: dict[str, Replica] = {}
        for rank in range(ranks):
            r = Replica(next(self.ids), rank, 1, T.RUNNING, "", running_at=T0)
            self.reps[r.id] = r
        self.p = Progress(strategy, generation=2, from_generation=1, batch_size=batch)
        self.reports: dict[str, tuple[int, datetime]] = {}
        self.last: Step | None = None

    def tick(self, advance_s: float = 0.0) -> Step:
        self.now += timedelta(seconds=advance_s)
        st = step(self.p, list(self.reps.values()), self.now, self.policy, self.reports)
        self.apply(st)
        return st

    def apply(self, st: Step) -> None:
        p = st.progress
        made: dict[int, str] = {}
        for c in st.create:
            src = self.reps[c.source]
            r = Replica(next(self.ids), c.rank, src.generation if c.restore else p.generation,
                        T.PENDING, CANDIDATE)
            self.reps[r.id] = r
            made[c.rank] = r.id
        if made:
            p = replace(p, candidates={**p.candidates, **made})
        for tid in st.drain:
            self.reps[tid] = replace(self.reps[tid], draining=True)
        for tid in st.undrain:
            self.reps[tid] = replace(self.reps[tid], draining=False)
        for pr in st.promote:
            self.reps[pr.candidate] = replace(self.reps[pr.candidate], replaced_by="")
            for old in pr.olds:
                self.reps[old] = replace(self.reps[old], replaced_by=pr.candidate)
                self.stop(old)
        for tid in st.stop:
            self.stop(tid)
        self.p = p
        self.last = st

    def stop(self, tid: str) -> None:
        if self.reps[tid].status not in (T.STOPPED, T.FAILED, T.COMPLETED):
            self.reps[tid] = replace(self.reps[tid], status=T.STOPPED)

    def run(self, tid: str) -> None:
        self.reps[tid] = replace(self.reps[tid], status=T.RUNNING, running_at=self.now)

    def pend(self, tid: str, why: str) -> None:
        """The scheduler's word on a candidate it cannot place (it stays pending)."""
        self.reps[tid] = replace(self.reps[tid], message=why)

    def fail(self, tid: str, why: str = "engine exited with code 2") -> None:
        self.reps[tid] = replace(self.reps[tid], status=T.FAILED, message=why)

    def live_candidates(self) -> list[str]:
        return [r.id for r in self.reps.values() if r.candidate and r.live]

    def current(self) -> list[Replica]:
        return sorted((r for r in self.reps.values() if r.current), key=lambda r: r.rank)

    def gens(self) -> list[tuple[int, int]]:
        return [(r.rank, r.generation) for r in self.current()]


def roll_batch(w: World, *, report: bool = False) -> None:
    """One batch from its candidates' creation to the switch."""
    st = w.tick()
    assert [c.rank for c in st.create] == list(w.p.batch)
    assert "new generation starting (attempt 1 of 4)" in st.message
    for tid in w.live_candidates():
        w.tick(1)  # not running yet: waits
        w.run(tid)
    st = w.tick()
    assert "the gateways learn of it" in st.message and not st.drain
    olds = [r.id for rank in w.p.batch for r in w.current() if r.rank == rank]
    st = w.tick(2)
    assert sorted(st.drain) == sorted(olds) and "old generation draining" in st.message
    if report:  # the gateways: nothing in flight, as of after the mark was everywhere
        for o in olds:
            w.reports[o] = (0, w.now + timedelta(seconds=2.5))
        st = w.tick(1)
        assert not st.promote  # not before drain_min_s
        st = w.tick(2)
    else:
        st = w.tick(29)
        assert not st.promote
        st = w.tick(1)  # the drain timeout
    assert [pr.olds for pr in st.promote] == [(o,) for o in olds]
    assert "switched to generation 2" in st.message


def test_a_rolling_update_goes_batch_by_batch_to_done() -> None:
    w = World(ranks=3, batch=2)
    roll_batch(w, report=True)
    assert w.gens() == [(0, 2), (1, 2), (2, 1)]
    assert w.last is not None and w.last.state == RolloutState.ROLLING
    roll_batch(w)
    assert w.gens() == [(0, 2), (1, 2), (2, 2)]
    st = w.tick()
    assert st.state == RolloutState.DONE and st.finished
    assert st.message == "generation 2 serves on every replica (3)"
    assert [k for k, _ in st.events] == [EventKind.ROLLOUT_DONE]
    # the old ones stopped only when switched, never before their batch
    assert all(r.status == T.STOPPED for r in w.reps.values() if r.generation == 1)


def test_batch_labels_count_batches() -> None:
    w = World(ranks=3, batch=2)
    assert "batch 1/2 (ranks 0, 1)" in w.tick().message
    w = World(ranks=2, batch=1)
    assert "batch 1/2 (rank 0)" in w.tick().message


def test_the_drain_rule() -> None:
    since = T0
    at = since + timedelta(seconds=POLICY.drain_min_s)
    assert not drained(since, None, since + timedelta(seconds=29), POLICY)
    assert drained(since, None, since + timedelta(seconds=30), POLICY)  # the timeout
    assert not drained(since, (0, at), since + timedelta(seconds=1), POLICY)  # too soon
    assert drained(since, (0, at), since + timedelta(seconds=3), POLICY)
    assert not drained(since, (1, at), since + timedelta(seconds=3), POLICY)  # in flight
    early = since + timedelta(seconds=1)  # made before every gateway saw the mark
    assert not drained(since, (0, early), since + timedelta(seconds=3), POLICY)


def test_a_failed_candidate_is_tried_again_and_the_old_replica_serves_on() -> None:
    w = World()
    w.tick()
    (c1,) = w.live_candidates()
    w.fail(c1, "engine exited with code 2; bad flag")
    st = w.tick()
    assert st.state == RolloutState.ROLLING and w.p.attempt == 2
    assert "attempt 1 of 4 failed" in st.message and "bad flag" in st.message
    assert [k for k, _ in st.events] == [EventKind.ROLLOUT_RETRY]
    st = w.tick()
    assert "attempt 2 of 4" in st.message and len(st.create) == 1
    assert all(not r.draining and r.status == T.RUNNING for r in w.current())


def test_a_candidate_that_fails_while_the_old_one_drains_undrains_it() -> None:
    w = World()
    w.tick()
    (c1,) = w.live_candidates()
    w.run(c1)
    w.tick(2)
    old = w.current()[0].id
    assert w.reps[old].draining
    w.fail(c1)
    st = w.tick()
    assert st.undrain == (old,) and not w.reps[old].draining and w.p.attempt == 2


def test_a_candidate_not_running_in_time_fails_its_attempt() -> None:
    w = World()
    w.tick()
    (c1,) = w.live_candidates()
    st = w.tick(99)
    assert "starting" in st.message
    st = w.tick(1)
    assert "not running and healthy within 100 s" in st.message
    assert st.stop == (c1,) and w.p.attempt == 2


def test_a_running_candidate_of_a_failed_attempt_is_drained_before_it_stops() -> None:
    w = World(ranks=2, batch=2)
    w.tick()
    a, b = w.live_candidates()
    w.run(a)
    w.fail(b)
    st = w.tick()
    assert a in w.p.retiring and a not in st.stop  # it may hold requests: drain first
    st = w.tick(29)
    assert a not in st.stop
    st = w.tick(1)
    assert a in st.stop and a not in w.p.retiring


def fail_every_attempt(w: World) -> Step:
    for _ in range(POLICY.attempts):
        w.tick()
        (c,) = w.live_candidates()
        w.fail(c, "unknown flag --bogus")
        st = w.tick()
    return st


def test_after_the_last_attempt_the_update_rolls_back() -> None:
    w = World()
    st = fail_every_attempt(w)
    assert st.state == RolloutState.ROLLING_BACK and w.p.rolling_back
    assert "batch 1/2 (rank 0) failed 4 times" in st.message
    assert [k for k, _ in st.events] == [EventKind.ROLLOUT_ROLLBACK]
    st = w.tick()  # nothing was switched: nothing to restore
    assert st.state == RolloutState.FAILED and st.finished
    assert st.message.endswith("rolled back: generation 1 serves")
    assert w.gens() == [(0, 1), (1, 1)]


def test_rollback_restores_the_replicas_a_finished_batch_replaced() -> None:
    w = World()
    roll_batch(w)
    (new0,) = [r.id for r in w.current() if r.rank == 0]
    fail_every_attempt(w)
    st = w.tick()
    assert [(c.rank, c.restore) for c in st.create] == [(0, True)]
    assert "generation 1 starting again" in st.message
    (restore,) = w.live_candidates()
    assert w.reps[restore].generation == 1  # a copy of what the update retired
    w.run(restore)
    st = w.tick(2)
    assert st.drain == (new0,)
    st = w.tick(30)
    assert st.promote[0].candidate == restore and st.promote[0].olds == (new0,)
    st = w.tick()
    assert st.state == RolloutState.FAILED and "rolled back: generation 1 serves" in st.message
    assert w.gens() == [(0, 1), (1, 1)]


def test_a_restore_that_fails_keeps_the_new_generation_on_that_rank() -> None:
    w = World()
    roll_batch(w)
    fail_every_attempt(w)
    w.tick()
    (restore,) = w.live_candidates()
    w.fail(restore)
    st = w.tick()
    assert "did not come back on rank 0" in st.message
    st = w.tick()
    assert st.state == RolloutState.FAILED
    assert "generation 1 on rank 1; generation 2 on rank 0" in st.message
    assert "could not be restored" in st.message


def test_recreate_drains_stops_all_then_creates_all() -> None:
    w = World(ranks=2, strategy=Strategy.RECREATE)
    olds = [r.id for r in w.current()]
    st = w.tick()
    assert sorted(st.drain) == sorted(olds) and st.state == RolloutState.RECREATING
    w.tick(29)
    st = w.tick(1)
    assert sorted(st.stop) == sorted(olds) and w.p.old_stopped
    st = w.tick()
    assert [c.rank for c in st.create] == [0, 1] and "batch 1/1" in st.message
    for tid in w.live_candidates():
        w.run(tid)
    st = w.tick()
    assert len(st.promote) == 2 and "switched to generation 2" in st.message
    st = w.tick()
    assert st.state == RolloutState.DONE and w.gens() == [(0, 2), (1, 2)]


def test_recreate_rollback_restores_every_stopped_replica() -> None:
    w = World(ranks=2, strategy=Strategy.RECREATE)
    w.tick()
    w.tick(30)  # stopped
    for _ in range(POLICY.attempts):
        w.tick()
        for tid in w.live_candidates():
            w.fail(tid)
        w.tick()
    assert w.p.rolling_back
    st = w.tick()
    assert sorted((c.rank, c.restore) for c in st.create) == [(0, True), (1, True)]
    for tid in w.live_candidates():
        w.run(tid)
    st = w.tick(2)
    assert len(st.promote) == 2  # nothing to drain: the old ones were stopped
    st = w.tick()
    assert st.state == RolloutState.FAILED and w.gens() == [(0, 1), (1, 1)]


def test_lease_renew_expiry_and_the_hold_bound() -> None:
    p = RolloutPolicy()  # 60 s TTL, renewed every 15 s, 16 min at most
    exp = T0 + timedelta(seconds=60)
    assert lease_action(T0, exp, T0 + timedelta(seconds=14), p) == "hold"
    assert lease_action(T0, exp, T0 + timedelta(seconds=15), p) == "renew"
    assert lease_action(T0, exp, T0 + timedelta(seconds=61), p) == "expired"
    assert lease_action(T0, None, T0, p) == "expired"
    late = T0 + timedelta(seconds=960)
    assert lease_action(T0, late + timedelta(seconds=30), late, p) == "too_long"


def test_abandon_leaves_the_group_serving_as_it_stands() -> None:
    w = World(ranks=3)
    roll_batch(w)  # rank 0 switched
    w.tick()
    (pending,) = w.live_candidates()  # rank 1's, not running yet
    st = abandon(w.p, list(w.reps.values()), "the holder died", hard=False)
    assert st.state == RolloutState.FAILED and st.finished and st.stop == (pending,)
    assert "generation 1 on ranks 1, 2; generation 2 on rank 0" in st.message
    # a running candidate is drained, not killed; old replicas drained serve again
    w.run(pending)
    w.tick(2)  # rank 1's old replica drains
    old1 = next(r.id for r in w.current() if r.rank == 1)
    assert w.reps[old1].draining
    st = abandon(w.p, list(w.reps.values()), "the holder died", hard=False)
    assert st.drain == (pending,) and st.stop == () and st.undrain == (old1,)
    st = abandon(w.p, list(w.reps.values()), "stopped by its owner", hard=True)
    assert st.stop == (pending,)


def test_orphans_are_drained_then_stopped() -> None:
    now = T0
    reps = [
        Replica("a", 0, 2, T.PENDING, CANDIDATE),
        Replica("b", 1, 2, T.RUNNING, CANDIDATE),
        Replica("c", 2, 2, T.RUNNING, CANDIDATE, draining=True),
        Replica("d", 3, 2, T.RUNNING, CANDIDATE, draining=True),
        Replica("e", 4, 2, T.RUNNING, CANDIDATE),  # its rollout still owns it
        Replica("f", 5, 2, T.RUNNING, ""),  # current: never an orphan
    ]
    marks = {"c": now - timedelta(seconds=31), "d": now - timedelta(seconds=5)}
    stop, drain = orphans(reps, {"e"}, marks.get, now, POLICY)
    assert (stop, drain) == (["a", "c"], ["b"])


def test_progress_round_trips_through_json() -> None:
    w = World(ranks=2, batch=2)
    w.tick()
    a, b = w.live_candidates()
    w.run(a)
    w.fail(b)
    w.tick()
    p = replace(w.p, drain_since=T0, given_up=(1,))
    assert progress_from_json(progress_to_json(p)) == p


@pytest.mark.parametrize("strategy", list(Strategy))
def test_every_step_names_its_state(strategy: Strategy) -> None:
    w = World(strategy=strategy)
    st = w.tick()
    assert st.state in (RolloutState.ROLLING, RolloutState.RECREATING)
    assert st.message


def test_recreate_of_work_without_traffic_stops_without_draining() -> None:
    w = World(ranks=2, strategy=Strategy.RECREATE)
    w.p = replace(w.p, drain=False)
    olds = sorted(r.id for r in w.current())
    st = w.tick()
    assert sorted(st.stop) == olds and not st.drain and w.p.old_stopped


def test_a_failure_is_told_by_the_engine_s_error_line() -> None:
    from heteroflow.core.rollout import first_line

    message = "engine exited with code 2; last output:\nusage: ...\nerror: bad --x\n(see --help)"
    assert first_line(message) == "engine exited with code 2; last output: error: bad --x"
    assert first_line("no reason\nmore") == "no reason"
    assert first_line("") == ""


# ---- the progress deadline (issue 26): a stuck update fails, rolls back, lets go --------

UNPLACEABLE = "no node can run it: process runtime (this needs a Docker node)"


def test_an_update_stuck_on_an_unplaceable_replica_fails_at_the_deadline() -> None:
    w = World(policy=replace(POLICY, progress_deadline_s=150))
    w.tick()
    (c1,) = w.live_candidates()
    w.pend(c1, UNPLACEABLE)
    st = w.tick(100)  # the attempt timed out: tried again, and the message says why
    assert "attempt 1 of 4 failed" in st.message and UNPLACEABLE in st.message
    assert st.stop == (c1,) and st.state == RolloutState.ROLLING
    assert "attempt 2 of 4" in w.tick().message  # its new candidate
    (c2,) = w.live_candidates()
    w.pend(c2, UNPLACEABLE)
    st = w.tick(49)
    assert st.state == RolloutState.ROLLING and not st.stop  # 149 s: still its time
    st = w.tick(1)  # 150 s without a batch switched: no more retries, it rolls back
    assert st.state == RolloutState.ROLLING_BACK and st.stop == (c2,)
    assert "no progress for 150 s" in st.message and f"{c2} (rank 0) is still pending" in st.message
    assert UNPLACEABLE in st.message
    assert (EventKind.ROLLOUT_ROLLBACK, st.message) in st.events
    st = w.tick()  # nothing was switched: nothing to restore
    assert st.state == RolloutState.FAILED and st.finished  # the lock is released
    assert "no progress for 150 s" in st.message
    assert "rolled back: generation 1 serves" in st.message
    assert w.gens() == [(0, 1), (1, 1)]


def test_a_switched_batch_is_progress_and_a_later_stuck_one_restores_it() -> None:
    w = World(policy=replace(POLICY, ready_timeout_s=1000, progress_deadline_s=150))
    roll_batch(w)  # rank 0 switched to generation 2, some 35 s in
    switched_at = w.now
    st = w.tick()
    assert st.create and w.p.progress_at == switched_at
    (c,) = w.live_candidates()
    w.pend(c, UNPLACEABLE)
    st = w.tick(149)  # 149 s since the switch (more since the start): still its time
    assert st.state == RolloutState.ROLLING and "attempt 1 of 4" in st.message
    st = w.tick(1)
    assert st.state == RolloutState.ROLLING_BACK and "no progress for 150 s" in st.message
    st = w.tick()  # the rollback's rules: rank 0 gets generation 1 back
    assert [(c.rank, c.restore) for c in st.create] == [(0, True)]


@pytest.mark.feature("H7")
def test_a_candidate_whose_image_cannot_be_pulled_fails_the_update_at_once() -> None:
    w = World()
    w.tick()
    (c1,) = w.live_candidates()
    why = "image pull failed (not found): reg:5000/engine:nope; manifest unknown"
    w.reps[c1] = replace(w.reps[c1], status=T.FAILED, message=why, unpullable=True)
    st = w.tick()
    # no retry: rolling back at the first attempt, and nothing was ever drained
    assert st.state == RolloutState.ROLLING_BACK and w.p.attempt == 1
    assert "not found" in st.message and "not retried" in st.message
    assert not any(r.draining for r in w.reps.values())
    st = w.tick()
    assert st.state == RolloutState.FAILED and st.finished
    assert w.gens() == [(0, 1), (1, 1)]
    assert all(r.status == T.RUNNING for r in w.current())


@pytest.mark.feature("H7")
def test_a_pull_that_may_heal_is_tried_again_as_any_failed_start() -> None:
    w = World()
    w.tick()
    (c1,) = w.live_candidates()
    w.fail(c1, "image pull failed (unreachable): reg:5000/engine:v2; connection refused")
    st = w.tick()
    assert st.state == RolloutState.ROLLING and w.p.attempt == 2


# --- D5: readiness follows loading (core/rollout/readiness.py) ---

LOAD_POLICY = replace(POLICY, ready_timeout_s=100, progress_deadline_s=400, load_news_s=60)


def load_note(w: World, tid: str, text: str = "loading: 1.2 of 40 GB, ~9 min left",
              busy: str = "loading") -> None:
    """The candidate's agent notes how far its load got (a D5 'progress' note)."""
    w.reps[tid] = replace(
        w.reps[tid], status=T.STARTING, busy=busy, news_at=w.now, message=text
    )


@pytest.mark.feature("D5")
def test_a_candidate_that_loads_with_progress_is_never_late() -> None:
    w = World(policy=LOAD_POLICY)
    w.tick()
    (c1,) = w.live_candidates()
    for _ in range(60):  # 600 s of a 70B load: past ready_timeout_s and the deadline
        w.tick(10)
        load_note(w, c1)
    st = w.tick()
    assert st.state == RolloutState.ROLLING and not st.stop and w.p.attempt == 1
    assert f"{c1}: loading: 1.2 of 40 GB, ~9 min left" in st.message
    w.run(c1)
    st = w.tick()
    assert "the gateways learn of it" in st.message and w.live_candidates() == [c1]


@pytest.mark.feature("D5")
def test_a_candidate_not_loading_counts_against_the_ready_timeout() -> None:
    w = World(policy=LOAD_POLICY)
    w.tick()
    (c1,) = w.live_candidates()
    w.reps[c1] = replace(w.reps[c1], status=T.STARTING, message="launching")
    w.tick(99)
    st = w.tick(1)
    assert "not running and healthy within 100 s and not loading" in st.message
    assert st.stop == (c1,) and w.p.attempt == 2


@pytest.mark.feature("D5")
def test_a_load_whose_agent_went_quiet_is_late_and_says_so() -> None:
    w = World(policy=LOAD_POLICY)
    w.tick()
    (c1,) = w.live_candidates()
    w.tick(90)
    load_note(w, c1)  # the last word from its agent (then its node is lost)
    st = w.tick(59)  # 149 s: past ready_timeout_s, but the news is 59 s old
    assert not st.stop and w.p.attempt == 1
    st = w.tick(1)
    assert st.stop == (c1,) and w.p.attempt == 2
    assert "it was loading but its agent has said nothing of it for 60 s" in st.message


@pytest.mark.feature("D5")
def test_an_image_pull_with_progress_is_not_late_either() -> None:
    w = World(policy=LOAD_POLICY)
    w.tick()
    (c1,) = w.live_candidates()
    for _ in range(30):
        w.tick(10)
        load_note(w, c1, "pulling: 3.1 of 9.8 GB", busy="pulling")
    assert w.p.attempt == 1 and not w.last.stop  # type: ignore[union-attr]
    st = w.tick(60)
    assert "it was pulling but its agent has said nothing" in st.message


@pytest.mark.feature("D5")
def test_the_progress_deadline_spares_a_load_until_it_goes_quiet() -> None:
    w = World(policy=replace(LOAD_POLICY, ready_timeout_s=1000))
    w.tick()
    (c1,) = w.live_candidates()
    for _ in range(45):  # 450 s: past progress_deadline_s (400) while it loads
        w.tick(10)
        load_note(w, c1)
    assert w.last is not None and w.last.state == RolloutState.ROLLING
    st = w.tick(60)  # 60 s without news: the update stalled
    assert st.state == RolloutState.ROLLING_BACK
    assert "no progress for 400 s" in st.message and c1 in st.message


@pytest.mark.feature("D5")
def test_a_restore_that_loads_is_not_given_up() -> None:
    w = World(ranks=1, policy=LOAD_POLICY)
    roll_batch(w)
    w.p = replace(w.p, rolling_back=True, reason="test")
    st = w.tick()
    assert [c.restore for c in st.create] == [True]
    (c,) = w.live_candidates()
    for _ in range(30):
        w.tick(10)
        load_note(w, c)
    assert w.last is not None and not w.last.stop and not w.p.given_up
    st = w.tick(100)  # quiet: the restore is late
    assert st.stop == (c,) and list(w.p.given_up) == [0]
    assert "did not come back on rank 0 (not running and healthy within 100 s" in st.message


# --- recreate pre-pulls the new image before anything drains (J2, H7) ---

NEW = "reg:5000/engine:v2"


def recreate_with_prepull(ranks: int = 2) -> World:
    w = World(ranks=ranks, strategy=Strategy.RECREATE)
    w.p = replace(w.p, prepull_image=NEW)
    return w


def prepull(w: World, tid: str, outcome: str, why: str = "") -> None:
    w.reps[tid] = replace(w.reps[tid], prepull=outcome, prepull_message=why)


@pytest.mark.feature("J2", "H7")
def test_recreate_drains_nothing_until_the_new_image_is_on_every_old_node() -> None:
    w = recreate_with_prepull()
    olds = [r.id for r in w.current()]
    st = w.tick()
    assert st.state == RolloutState.RECREATING and not st.drain and not st.stop
    assert "being pulled on the old replicas' nodes (0 of 2 ready)" in st.message
    prepull(w, olds[0], "pulled")
    prepull(w, olds[1], "failed", "image pull failed (unreachable): reg:5000; refused")
    st = w.tick(30)
    assert not st.drain and "1 of 2 ready" in st.message and "unreachable" in st.message
    prepull(w, olds[1], "pulled")  # its agent tried again
    st = w.tick(5)
    assert w.p.prepulled and "present on the nodes of every old replica (2)" in st.message
    assert not st.drain and not st.stop
    st = w.tick()  # then recreate as before: drain, stop, create
    assert sorted(st.drain) == sorted(olds)


@pytest.mark.feature("J2", "H7")
def test_recreate_to_an_image_that_cannot_be_pulled_fails_with_nothing_stopped() -> None:
    w = recreate_with_prepull()
    olds = [r.id for r in w.current()]
    w.tick()
    prepull(w, olds[1], "unavailable", "image pull failed (not found): reg:5000/engine:v2")
    st = w.tick(1)
    assert st.state == RolloutState.FAILED and st.finished
    assert "cannot be pulled" in st.message and "not found" in st.message
    assert "nothing was stopped: generation 1 serves" in st.message
    assert not st.stop and not st.drain and not st.create
    assert all(w.reps[o].status == T.RUNNING and not w.reps[o].draining for o in olds)


@pytest.mark.feature("J2", "H7")
def test_a_recreate_pre_pull_that_never_finishes_fails_at_the_deadline() -> None:
    w = recreate_with_prepull()
    w.tick()
    st = w.tick(POLICY.progress_deadline_s - 1)
    assert st.state == RolloutState.RECREATING
    st = w.tick(1)
    assert st.state == RolloutState.FAILED and "within 600 s" in st.message
    assert "no word from its agent yet" in st.message and not st.stop
