"""``heteroflow services top ID``: a service's live series as sparklines (issue 33),
from ``GET /api/v1/task-groups/{id}/series`` — one line per metric: its name, the last
``--since`` at the server's step, the last value and the highest."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from heteroflow.cmd.remote import check, print_json, session
from heteroflow.core.series import sparkline

# what is printed, in order, with its unit
SHOWN = (
    ("requests_per_s", "req/s"),
    ("tokens_per_s", "tok/s"),
    ("latency_p50_ms", "ms"),
    ("latency_p95_ms", "ms"),
    ("ttft_p95_ms", "ms"),
    ("errors_per_s", "err/s"),
    ("in_flight", ""),
    ("queue", ""),
    ("replicas", ""),
)
WIDTH = 60


def top(group_id: str, since: str, as_json: bool = False) -> None:
    metrics = ",".join(m for m, _ in SHOWN)
    with session() as c:
        answer = check(
            c.get(f"/api/v1/task-groups/{group_id}/series",
                  params={"metrics": metrics, "since": since})
        )
    if as_json:
        print_json(answer)
        return
    print(render(answer))


def render(answer: Mapping[str, Any]) -> str:
    values: Mapping[str, list[float | None]] = answer.get("values", {})
    times = answer.get("times", [])
    lines = [f"last {len(times)} points, every {answer.get('step')} s (oldest left)"]
    for name, unit in SHOWN:
        series = values.get(name, [])
        known = [v for v in series if v is not None]
        last = f"{known[-1]:.4g}" if known else "—"
        peak = f"{max(known):.4g}" if known else "—"
        lines.append(
            f"{name:<15} {sparkline(series, WIDTH):<{WIDTH}}  now {last} {unit}".rstrip()
            + f"  max {peak}"
        )
    events = answer.get("events", [])
    for e in events[-5:]:
        lines.append(f"event {e.get('at')} {e.get('kind')}: {e.get('message') or ''}".rstrip())
    return "\n".join(lines)
