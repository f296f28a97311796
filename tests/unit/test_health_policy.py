"""Container health-check policy: config parsing (D3) and the verdicts over time (D2)."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.core.health import HealthCheckConfig, HealthTracker, HealthVerdict

D2 = pytest.mark.feature("D2")
D3 = pytest.mark.feature("D3")

V = HealthVerdict


def tracker(start_period_s: float = 60, threshold: int = 3, interval_s: float = 10,
            started_at: float = 1000.0) -> HealthTracker:
    cfg = HealthCheckConfig(start_period_s=start_period_s, unhealthy_threshold=threshold,
                            interval_s=interval_s)
    return HealthTracker(cfg, started_at=started_at)


@D2
def test_failures_inside_start_period_are_ignored_not_counted() -> None:
    t = tracker(start_period_s=60)
    for now in (1000.0, 1010.0, 1030.0, 1059.9):
        assert t.record(False, now, "connection refused") is V.IGNORED_IN_START_PERIOD
    assert t.consecutive_failures == 0
    assert t.last_detail == "connection refused"
    assert t.record(False, 1060.0) is V.FAILING
    assert t.consecutive_failures == 1


@D2
def test_start_period_failures_stay_ignored_after_a_pass() -> None:
    t = tracker(start_period_s=60)
    assert t.record(True, 1005.0) is V.HEALTHY_FIRST
    assert t.record(False, 1015.0) is V.IGNORED_IN_START_PERIOD
    assert t.consecutive_failures == 0


@pytest.mark.feature("D5")
def test_failures_while_loading_are_never_counted_after_the_start_period() -> None:
    t = tracker(start_period_s=5, threshold=3)
    assert t.record(False, 1001.0, "HTTP 503: Loading model", loading=True) is (
        V.IGNORED_IN_START_PERIOD
    )
    for now in (1010.0, 1100.0, 1900.0):  # long past the start period: still loading
        assert t.record(False, now, "connection refused", loading=True) is (
            V.IGNORED_WHILE_LOADING
        )
    assert t.consecutive_failures == 0 and t.last_detail == "connection refused"
    assert t.record(True, 1901.0, "HTTP 200", loading=True) is V.HEALTHY_FIRST
    # the window closed at the pass: D2's counting from here on
    assert [t.record(False, 1902.0 + i) for i in range(3)] == [V.FAILING, V.FAILING, V.UNHEALTHY]


@D2
def test_threshold_consecutive_failures_make_it_unhealthy() -> None:
    t = tracker(start_period_s=0, threshold=3)
    assert t.record(False, 1000.0) is V.FAILING
    assert t.record(False, 1010.0) is V.FAILING
    assert t.record(False, 1020.0, "HTTP 500") is V.UNHEALTHY
    assert t.consecutive_failures == 3
    assert t.last_detail == "HTTP 500"


@D2
def test_default_threshold_is_three() -> None:
    t = HealthTracker(HealthCheckConfig(), started_at=0.0)
    verdicts = [t.record(False, 100.0 + 10 * i) for i in range(3)]
    assert verdicts == [V.FAILING, V.FAILING, V.UNHEALTHY]


@D2
def test_success_resets_the_consecutive_count() -> None:
    t = tracker(start_period_s=0, threshold=3)
    t.record(False, 1000.0)
    t.record(False, 1010.0)
    assert t.record(True, 1020.0) is V.HEALTHY_FIRST
    assert t.consecutive_failures == 0
    assert t.record(False, 1030.0) is V.FAILING
    assert t.record(False, 1040.0) is V.FAILING
    assert t.record(False, 1050.0) is V.UNHEALTHY


@D2
def test_first_pass_is_reported_once() -> None:
    t = tracker()
    assert not t.passed_once
    assert t.record(True, 1001.0, "HTTP 200") is V.HEALTHY_FIRST
    assert t.passed_once
    assert t.record(True, 1011.0) is V.HEALTHY
    assert t.record(True, 1021.0) is V.HEALTHY


@D2
def test_pause_and_resume_reset_counter_and_restart_start_period() -> None:
    t = tracker(start_period_s=60, threshold=3)
    t.record(True, 1000.0)
    t.record(False, 1100.0)
    t.record(False, 1110.0)
    assert t.consecutive_failures == 2
    t.pause()
    assert t.paused and t.consecutive_failures == 0
    assert not t.due(5000.0)
    assert t.record(False, 1120.0) is V.IGNORED_WHILE_PAUSED
    assert t.consecutive_failures == 0
    t.resume(2000.0)
    assert not t.paused and t.due(2000.0)
    assert t.in_start_period(2059.0) and not t.in_start_period(2060.0)
    assert t.record(False, 2030.0) is V.IGNORED_IN_START_PERIOD
    assert t.record(True, 2040.0) is V.HEALTHY  # first pass ever was before the sleep
    assert t.record(False, 2070.0) is V.FAILING
    assert t.consecutive_failures == 1


@D2
def test_due_follows_the_interval() -> None:
    t = tracker(interval_s=10)
    assert t.due(1000.0)  # first probe at once
    t.record(False, 1000.0)
    assert not t.due(1009.9)
    assert t.due(1010.0)


@D2
@D3
def test_start_period_zero_means_30_and_missing_means_60() -> None:
    assert HealthCheckConfig.from_api({"start_period_seconds": 0}).start_period_s == 30
    assert HealthCheckConfig.from_api({}).start_period_s == 60
    assert HealthCheckConfig.from_api({"start_period_seconds": None}).start_period_s == 60
    assert HealthCheckConfig.from_api(None).start_period_s == 60
    assert HealthCheckConfig.from_api({"start_period_seconds": 300}).start_period_s == 300


@D3
def test_from_api_reads_all_fields() -> None:
    cfg = HealthCheckConfig.from_api({
        "type": "tcp", "path": "/ready", "port": 8000, "interval_seconds": 5,
        "timeout_seconds": 2.5, "unhealthy_threshold": 5, "start_period_seconds": 600,
    })
    assert cfg == HealthCheckConfig(type="tcp", path="/ready", port=8000, interval_s=5.0,
                                    timeout_s=2.5, unhealthy_threshold=5, start_period_s=600.0)


@D3
def test_from_api_defaults() -> None:
    cfg = HealthCheckConfig.from_api(None)
    assert (cfg.type, cfg.path, cfg.port) == ("http", "/health", None)
    assert (cfg.interval_s, cfg.timeout_s, cfg.unhealthy_threshold) == (10, 3, 3)


@D3
@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"interval_seconds": 0}, "interval_seconds"),
        ({"interval_seconds": -5}, "interval_seconds"),
        ({"interval_seconds": "10"}, "interval_seconds"),
        ({"timeout_seconds": 0}, "timeout_seconds"),
        ({"unhealthy_threshold": 0}, "unhealthy_threshold"),
        ({"unhealthy_threshold": 2.5}, "unhealthy_threshold"),
        ({"unhealthy_threshold": True}, "unhealthy_threshold"),
        ({"port": 0}, "port"),
        ({"port": 65536}, "port"),
        ({"port": "8000"}, "port"),
        ({"path": "health"}, "path"),
        ({"path": "/he alth"}, "path"),
        ({"type": "exec"}, "type"),
        ({"start_period_seconds": -1}, "start_period_seconds"),
        ({"intervall_seconds": 10}, "intervall_seconds"),
    ],
)
def test_from_api_validation_names_the_field(payload: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"^health_check\.{field}:"):
        HealthCheckConfig.from_api(payload)


@D3
def test_from_api_rejects_non_object() -> None:
    with pytest.raises(ValueError, match="must be an object"):
        HealthCheckConfig.from_api([1, 2])  # type: ignore[arg-type]


@D3
def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ValueError, match=r"health_check\.timeout_s"):
        HealthCheckConfig(timeout_s=0)
    assert HealthCheckConfig(start_period_s=0).start_period_s == 0
