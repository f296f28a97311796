"""What one ``Balancer.choose`` costs per algorithm (M15 ``capacity`` against
``least_connections``): time per call and blocks allocated per call, on one route of
``--backends`` backends with some requests in flight and (for ``capacity``) an estimate
for each. The hot path's budget is least_connections' own: ``capacity`` must allocate
nothing more per request.

``.venv/bin/python bench/balancer_choose.py [--backends 4 --calls 200000]``; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc

from heteroflow.gateway.routing.balancing import Balancer
from heteroflow.schemas.routing import Backend, RouteTarget


def _target(n: int, algorithm: str) -> RouteTarget:
    backends = tuple(Backend(task_id=f"t{i}", base_url=f"http://10.0.0.{i}:8000") for i in range(n))
    return RouteTarget("r", "g", 0, 100, backends, algorithm=algorithm)


def measure(algorithm: str, n: int, calls: int) -> tuple[float, float]:
    """(µs per choose, allocated blocks per choose) for ``algorithm``."""
    balancer = Balancer()
    target = _target(n, algorithm)
    targets = [target]
    for i, b in enumerate(target.backends):
        for _ in range(i % 3):
            balancer.acquire(b)
        balancer.observe(b, 1.0 + i, 100)  # capacity: every backend has an estimate
    choose = balancer.choose
    for _ in range(1000):
        choose(targets)
    start = time.process_time()  # CPU time: the machine may be shared
    for _ in range(calls):
        choose(targets)
    per_call_us = (time.process_time() - start) / calls * 1e6
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    for _ in range(10_000):
        choose(targets)
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(s.count_diff for s in after.compare_to(before, "filename") if s.count_diff > 0)
    return per_call_us, grown / 10_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--calls", type=int, default=200_000)
    a = ap.parse_args()
    out: dict[str, float] = {"backends": a.backends}
    for algorithm in ("round_robin", "least_connections", "capacity"):
        us, blocks = measure(algorithm, a.backends, a.calls)
        print(f"{algorithm:<18} {us:6.2f} µs/choose, {blocks:.3f} blocks kept per choose")
        out[f"us_per_choose_{algorithm}"] = round(us, 3)
        out[f"blocks_kept_per_choose_{algorithm}"] = round(blocks, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
