"""The recovery loop's pure decisions (core/recovery.py): the counter, its reset, the
cap, which failures are rebuilt, the engine fallback chain, the run timeout."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from heteroflow.core.events import EventKind
from heteroflow.core.recovery import (
    Attempt,
    GiveUp,
    Rebuild,
    RecoveryPolicy,
    Skip,
    decide,
    evacuation_paused,
    missing_cards,
    next_count,
    next_template,
    run_timed_out,
    start_failures_in_a_row,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = RecoveryPolicy(max_rebuilds=5, stable_s=60, fallback_after=2)
CHAIN = [
    {"engine": "vllm", "image": "vllm/vllm-openai:v0.11.2", "reason": "fits"},
    {"engine": "sglang", "image": "lmsysorg/sglang:v0.5", "reason": "fits too"},
    {"engine": "llamacpp", "image": "ghcr.io/ggml-org/llama.cpp:server", "reason": "any"},
]


def attempt(
    count: int = 0,
    ran_s: float | None = None,
    *,
    engine: str = "vllm",
    node: str | None = "node-a",
    fault: EventKind | None = EventKind.ENGINE_EXITED,
    task_id: str = "task-1",
) -> Attempt:
    running_at = None if ran_s is None else T0
    return Attempt(
        task_id=task_id,
        rebuild_count=count,
        engine=engine,
        image=f"{engine}:img",
        node_id=node,
        running_at=running_at,
        failed_at=T0 + timedelta(seconds=ran_s or 0),
        fault=fault,
    )


@pytest.mark.feature("E1")
def test_the_counter_counts_rebuilds_in_a_row_and_stops_after_five() -> None:
    assert next_count(attempt(0, ran_s=5), POLICY) == 1
    for n in range(5):
        d = decide([attempt(n, ran_s=5)], [], POLICY)
        assert isinstance(d, Rebuild) and d.count == n + 1
    d = decide([attempt(5, ran_s=5)], [], POLICY)
    assert isinstance(d, GiveUp)
    assert "5 times in a row" in d.reason and "60 s" in d.reason


@pytest.mark.feature("E1")
def test_sixty_seconds_of_running_starts_the_count_again() -> None:
    assert next_count(attempt(5, ran_s=59.9), POLICY) == 6  # not yet stable
    assert next_count(attempt(5, ran_s=60), POLICY) == 1
    d = decide([attempt(5, ran_s=600)], [], POLICY)
    assert isinstance(d, Rebuild) and d.count == 1
    # never ran at all: no reset however long it was starting
    assert next_count(attempt(2, ran_s=None), POLICY) == 3


def test_which_failures_are_rebuilt() -> None:
    # a service whatever failed it
    for fault in (None, EventKind.ENGINE_EXITED, EventKind.UNHEALTHY, EventKind.EVACUATED):
        assert isinstance(decide([attempt(fault=fault)], [], POLICY), Rebuild)
    # training / container: only off lost hardware
    for kind in ("training", "container"):
        own = decide([attempt(fault=EventKind.ENGINE_EXITED)], [], POLICY, task_type=kind)
        assert isinstance(own, Skip) and kind in own.reason
        assert isinstance(decide([attempt(fault=None)], [], POLICY, task_type=kind), Skip)
        timeout = decide([attempt(fault=EventKind.RUN_TIMEOUT)], [], POLICY, task_type=kind)
        assert isinstance(timeout, Skip)
        for lost in (EventKind.EVACUATED, EventKind.CONTAINER_LOST, EventKind.GPU_LOST):
            assert isinstance(decide([attempt(fault=lost)], [], POLICY, task_type=kind), Rebuild)
    pipeline = decide(
        [attempt(fault=EventKind.EVACUATED)], [], POLICY, task_type="training",
        parallelism="pipeline",
    )
    assert isinstance(pipeline, Skip) and "pipeline" in pipeline.reason


@pytest.mark.feature("E3")
def test_two_failed_starts_on_one_node_fall_back_to_the_next_template() -> None:
    one = decide([attempt(0)], CHAIN, POLICY)
    assert isinstance(one, Rebuild) and one.engine == "vllm" and not one.fallback
    two = decide([attempt(1, task_id="t2"), attempt(0)], CHAIN, POLICY)
    assert isinstance(two, Rebuild)
    assert (two.engine, two.image) == ("sglang", "lmsysorg/sglang:v0.5")
    assert "vllm failed to start 2 times" in two.fallback and "sglang" in two.fallback
    assert two.engine_reason.startswith("fallback after vllm")
    assert two.count == 2  # a fallback is a rebuild like any other
    # then sglang twice -> llama.cpp; the last of the chain has nowhere to go
    three = decide(
        [attempt(3, engine="sglang"), attempt(2, engine="sglang"), attempt(1)], CHAIN, POLICY
    )
    assert isinstance(three, Rebuild) and three.engine == "llamacpp"
    last = decide([attempt(4, engine="llamacpp"), attempt(3, engine="llamacpp")], CHAIN, POLICY)
    assert isinstance(last, Rebuild) and last.engine == "llamacpp" and not last.fallback


@pytest.mark.feature("E3")
def test_what_does_not_count_as_a_failed_start() -> None:
    # it had run: not a start failure
    assert start_failures_in_a_row([attempt(1, ran_s=5), attempt(0)]) == 0
    # another node, another engine, a lost node / card / container: the run breaks
    assert start_failures_in_a_row([attempt(1), attempt(0, node="node-b")]) == 1
    assert start_failures_in_a_row([attempt(1), attempt(0, engine="sglang")]) == 1
    for lost in (EventKind.EVACUATED, EventKind.CONTAINER_LOST, EventKind.NODE_LOST):
        assert start_failures_in_a_row([attempt(1), attempt(0, fault=lost)]) == 1
        assert start_failures_in_a_row([attempt(1, fault=lost), attempt(0)]) == 0
    # a named engine outside the chain, or no chain: rebuilt as it was
    d = decide([attempt(1, engine="trtllm"), attempt(0, engine="trtllm")], CHAIN, POLICY)
    assert isinstance(d, Rebuild) and d.engine == "trtllm"
    d = decide([attempt(1), attempt(0)], [], POLICY)
    assert isinstance(d, Rebuild) and d.engine == "vllm"
    assert next_template(CHAIN, "nope") is None and next_template(CHAIN, "llamacpp") is None


@pytest.mark.feature("A10")
def test_run_timeout_is_for_training_and_containers_only() -> None:
    assert run_timed_out(T0, T0 + timedelta(seconds=11), 10, "training")
    assert run_timed_out(T0, T0 + timedelta(seconds=11), 10, "container")
    assert not run_timed_out(T0, T0 + timedelta(seconds=10), 10, "training")  # not past yet
    assert not run_timed_out(T0, T0 + timedelta(days=9), 10, "inference")  # exempt by type
    assert not run_timed_out(T0, T0 + timedelta(days=9), 0, "training")  # 0 = none
    assert not run_timed_out(None, T0, 10, "training")  # never launched


def test_missing_cards() -> None:
    assert missing_cards([0, 1], [0, 1, 2]) == []
    assert missing_cards([0, 1], [0]) == [1]
    assert missing_cards([3], []) == [3]
    assert missing_cards([], []) == []


@pytest.mark.feature("E4")
def test_work_moves_off_a_node_lost_alone_but_not_off_most_lost_at_once() -> None:
    assert not evacuation_paused(0, 0, 0.55)  # nothing lost
    assert not evacuation_paused(1, 1, 0.55)  # one of two: that node's own loss
    assert not evacuation_paused(1, 2, 0.55)  # one of three (the cluster test's kill)
    assert evacuation_paused(2, 1, 0.55)  # two of three at once: more than the share
    assert not evacuation_paused(5, 10, 0.55)  # a third of the fleet still moves
    assert evacuation_paused(6, 4, 0.55)
    assert evacuation_paused(1, 0, 0.55)  # nobody heard from: nowhere to move anyway
    assert evacuation_paused(3, 0, 1.0)  # the threshold at 1: only a full disruption
    assert not evacuation_paused(9, 1, 1.0)



@pytest.mark.feature("H7")
def test_an_image_that_cannot_be_pulled_is_not_pulled_again() -> None:
    from heteroflow.core.recovery import Attempt, GiveUp, Rebuild, RecoveryPolicy, decide

    at = datetime(2026, 1, 1, tzinfo=UTC)
    failed = Attempt("task-1", 0, "vllm", "reg:5000/vllm:nope", "node-a", None, at,
                     fault=EventKind.IMAGE_UNAVAILABLE)
    alone = decide([failed], [], RecoveryPolicy())
    assert isinstance(alone, GiveUp) and "cannot be pulled" in alone.reason
    chain = [{"engine": "vllm", "image": "reg:5000/vllm:nope"},
             {"engine": "llamacpp", "image": "ghcr.io/ggml-org/llama.cpp:server", "reason": "r"}]
    nxt = decide([failed], chain, RecoveryPolicy())  # the chain's next engine, at once
    assert isinstance(nxt, Rebuild) and nxt.engine == "llamacpp" and nxt.count == 1
    assert "cannot be pulled" in nxt.fallback
    # a pull that may heal (no fault: registry unreachable, a timeout) is rebuilt as usual
    plain = decide([Attempt("task-1", 0, "vllm", "i", "node-a", None, at)], [], RecoveryPolicy())
    assert isinstance(plain, Rebuild) and plain.engine == "vllm"
