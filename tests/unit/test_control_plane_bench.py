"""bench/control_plane.py (issue 18, item 3): the simulated agents' bodies are what the
server accepts, beat after beat; the figures and the command line say what they claim.

The run itself (a real server on PostgreSQL and hundreds of agents for minutes) is the
benchmark, not a test: ``--quick`` is its smoke run.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from heteroflow.schemas.nodes import Heartbeat
from heteroflow.testing import clusters

from .bench_module import load_bench

cp = load_bench("control_plane")


def step(**over: Any) -> dict[str, Any]:
    return {"agents": 100, "beats": 200, "p99_ms": 10.0, "errors": 0, "errors_in_warmup": 0,
            **over}


def test_the_agents_bodies_are_heartbeats_the_server_accepts_beat_after_beat() -> None:
    rng = random.Random(3)
    body = cp.agent_heartbeat("h100-sxm-8", "bench-00001", rng).model_dump()
    first = json.loads(json.dumps(body))
    cards = [(g["memory_used_mb"], g["temperature_c"]) for g in body["inventory"]["gpus"]]
    models, ports = [], []
    for beat in range(1, 400):
        cp.churn(body, rng, beat)
        # what the server reads: the JSON the agent sends, validated as the route does
        hb = Heartbeat.model_validate_json(json.dumps(body))
        models.append(len(hb.models))
        ports.append(len(hb.host_ports_in_use))
        assert hb.host_ports_in_use == sorted(set(hb.host_ports_in_use))
    assert len(hb.inventory.gpus) == 8
    assert [(g.memory_used_mb, g.temperature_c) for g in hb.inventory.gpus] != cards
    assert {g["uuid"] for g in first["inventory"]["gpus"]} == {
        g.uuid for g in hb.inventory.gpus
    }
    # models appear and go, and so do ports, but neither list runs away
    assert len(set(models)) > 1 and max(models) <= cp.MODELS_PER_NODE + 1
    assert len(set(ports)) > 1 and max(ports) <= 41


def test_every_agent_reports_the_cards_of_an_eight_card_kind() -> None:
    rng = random.Random(1)
    for kind, _ in cp.FLEET_MIX:
        hb = cp.agent_heartbeat(kind, "n1", rng)
        declared = clusters.load(kind)
        assert [g.model for g in hb.inventory.gpus] == [c.model for c in declared.cards]
        assert all(g.source == "nvml" and g.temperature_c is not None
                   for g in hb.inventory.gpus)
        assert len(hb.models) == cp.MODELS_PER_NODE and hb.host_ports_in_use


def test_the_fleet_mix_is_seeded_and_proportioned() -> None:
    kinds = cp.fleet_kinds(2000, 7)
    assert kinds == cp.fleet_kinds(2000, 7) != cp.fleet_kinds(2000, 8)
    share = {k: kinds.count(k) / len(kinds) for k, _ in cp.FLEET_MIX}
    for kind, pct in cp.FLEET_MIX:
        assert abs(share[kind] - pct / 100) < 0.04, kind


def test_held_is_the_largest_step_under_the_limit_without_errors() -> None:
    steps = [step(agents=250), step(agents=500, p99_ms=49.9), step(agents=1000, p99_ms=50.0)]
    assert cp.held(steps) == 500
    assert cp.held([step(agents=250, errors_in_warmup=1)]) == 0
    assert cp.held([step(agents=250, errors=1)]) == 0
    assert cp.held([step(agents=250, beats=0)]) == 0
    assert cp.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 50) == 3.0
    assert cp.percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert cp.percentile([], 99) == 0.0


def test_pinning_puts_the_load_apart_from_the_servers() -> None:
    assert cp.parse_pin("auto", [0, 1]) == ([0], [1])
    assert cp.parse_pin("auto", [0, 1, 2, 3]) == ([0, 1, 2], [3])
    assert cp.parse_pin("auto", [0, 1, 2, 3], servers=2) == ([0, 1, 2], [3])
    # not a CPU for each server and the load: nothing is pinned
    assert cp.parse_pin("auto", [0, 1], servers=2) == (None, None)
    assert cp.parse_pin("auto", [0]) == (None, None)
    assert cp.parse_pin("none", [0, 1]) == (None, None)
    assert cp.parse_pin("0-2,5:3", [0, 1]) == ([0, 1, 2, 5], [3])
    for bad in ("0", ":1", "0:"):
        with pytest.raises(ValueError, match="SERVER_CPUS:LOAD_CPUS"):
            cp.parse_pin(bad, [0, 1])


@pytest.mark.parametrize(
    "argv",
    [["--pin", "0"], ["--server-env", "NO_EQUALS"], ["--steps", "0"], ["--servers", ""]],
)
def test_bad_arguments_stop_before_anything_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cp.main(argv)
    assert stopped.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_worker_phases_have_keys_of_their_own_and_are_pinned_as_processes() -> None:
    # issue 31, item 5: a server of two workers is two processes: on 2 cores, not pinned
    assert cp.phase_key(1) == "1_server" and cp.phase_key(2) == "2_servers"
    assert cp.phase_key(1, 2) == "1_server_2_workers"
    assert cp.parse_pin("auto", [0, 1], servers=1 * 2) == (None, None)
    assert cp.parse_pin("auto", [0, 1, 2], servers=1 * 2) == ([0, 1], [2])
    phase = {"servers": 1, "workers": 2, "held": 2000, "idle_server_cpu_pct": 1.0,
             "no_beats_cpu_pct": 2.0, "no_beats_nodes": 2000, "server_cpus": None,
             "load_cpus": None, "loadavg_start": [0.5], "loadavg_end": [1.0],
             "steps": [step(agents=2000, p50_ms=3.0, server_cpu_ms_per_beat=1.0,
                            beats_per_s=400.0, max_ms=20.0, server_cpu_pct=40.0,
                            pg_cpu_ms_per_beat=0.5, load_cpu_pct=20.0,
                            loop_lag_p99_ms=1.0)]}
    one = {**phase, "workers": 1, "held": 1500}
    out = cp.report([one, phase], {"cpus": 2})
    assert out["held_agents_1_server"] == 1500
    assert out["held_agents_1_server_2_workers"] == 2000
    assert out["held_agents_one_server_by_workers"] == {"1": 1500, "2": 2000}
    assert out["target_2000_agents_p99_50ms_one_server"] is True


def test_bad_worker_counts_stop_before_anything_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as stopped:
        cp.main(["--workers", "0"])
    assert stopped.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_beats_are_counted_per_worker_with_their_tail() -> None:
    samples = [cp.Sample(0.0, ms / 1000, True, 0.0, pid)
               for pid, ms in [(11, 1.0), (11, 3.0), (11, 2.0), (22, 9.0)]]
    samples.append(cp.Sample(0.0, 0.5, False, 0.0, 0))  # an error names no worker
    assert cp.by_worker(samples) == [[3, 3.0], [1, 9.0]]
    assert cp.by_worker([cp.Sample(0.0, 0.001, True, 0.0)]) == []  # one process
