"""M16's series in ``/metrics``: rendered, and summed over the workers of one gateway."""

from __future__ import annotations

import os
from pathlib import Path

from heteroflow.gateway.metrics import GatewayMetrics
from heteroflow.gateway.metrics_share import SharedMetrics


def _worker(tmp_path: Path, pid: int, refused: int) -> None:
    """Another (live: this process's pid is used for liveness) worker's file."""
    m = GatewayMetrics()
    for _ in range(refused):
        m.fair_refused("m", "queue_full")
    m.fair_waited("m", 0.2)
    m.fair_queued("m", 3)
    share = SharedMetrics(tmp_path, m)
    share._files._own = tmp_path / f"{pid}.metrics"  # as if written by that worker
    share.write()


def test_fair_share_series_render_and_sum_over_workers(tmp_path: Path) -> None:
    _worker(tmp_path, os.getpid(), refused=2)  # "alive": its gauge counts
    mine = GatewayMetrics()
    mine.fair_refused("m", "queue_full")
    mine.fair_refused("m", "wait_timeout")
    mine.fair_waited("m", 1.0)
    mine.fair_queued("m", 1)
    text = SharedMetrics(tmp_path / "none", mine).render().decode()
    assert 'heteroflow_gateway_fair_refusals_total{model="m",reason="wait_timeout"} 1' in text
    assert 'heteroflow_gateway_fair_queued{model="m"} 1' in text
    (tmp_path / "none").mkdir()
    own = SharedMetrics(tmp_path, mine)
    own._files._own = tmp_path / "mine.metrics"
    total = own.render().decode()
    assert 'heteroflow_gateway_fair_refusals_total{model="m",reason="queue_full"} 3' in total
    assert 'heteroflow_gateway_fair_wait_seconds_count{model="m"} 2' in total
    assert 'heteroflow_gateway_fair_queued{model="m"} 4' in total
