"""Summarise gateway harness runs: our CPU per request, errors, latency vs the baselines.

    python bench/gateway_summary.py RUN_DIR [RUN_DIR ...] [--soak soak.json]

Each RUN_DIR holds one harness run: ``results.jsonl``, the gateway's ``usage.jsonl`` and
``redis.json`` (Redis CPU seconds and commands during the run, from gateway.sh). Figures
are the median over the runs; errors are summed. ``added_p99_ms_c32`` / ``_c450``: our p99
minus the direct call's p99 under wrk at that concurrency, in the same run (wrk's
percentiles are corrected for coordinated omission: a stall of the event loop shows).
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

OURS = "heteroflow"


def _rows(run: Path) -> dict[tuple[str, str], dict[str, Any]]:
    with (run / "results.jsonl").open() as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {(r["target"], r["cell"]): r for r in rows if not r.get("tool_failed")}


def _cells(by: dict[tuple[str, str], dict[str, Any]], mode: str) -> list[tuple[int, str]]:
    """(concurrency, cell) of a mode, lowest concurrency first."""
    out = set()
    for _, cell in by:
        kind, conc, _tool = cell.split("/")
        if kind == mode:
            out.add((int(conc[1:]), cell))
    return sorted(out)


def _nonstream_cell(by: dict[tuple[str, str], dict[str, Any]], conc: int) -> str | None:
    names = [c for n, c in _cells(by, "nonstream") if n == conc]
    return next((c for c in names if c.endswith("/wrk")), names[0] if names else None)


def _get(
    by: dict[tuple[str, str], dict[str, Any]], target: str, cell: str | None, *keys: str
) -> Any:
    v: Any = by.get((target, cell or ""))
    for k in keys:
        v = v.get(k) if isinstance(v, dict) else None
    return v


def _added_p99(by: dict[tuple[str, str], dict[str, Any]], conc: int) -> float | None:
    """Our p99 minus the direct call's under wrk at ``conc``, same run (the tail we add)."""
    cell = f"nonstream/c{conc}/wrk"
    ours, direct = _get(by, OURS, cell, "lat_ms", "p99"), _get(by, "direct", cell, "lat_ms", "p99")
    return None if ours is None or direct is None else round(ours - direct, 3)


def _median(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _usage_requests(run: Path) -> int:
    path = run / "usage.jsonl"
    if not path.exists():
        return 0
    return sum(json.loads(line)["requests"] for line in path.read_text().splitlines() if line)


def summarize(runs: list[Path], soak: Path | None) -> dict[str, Any]:
    per_run: list[dict[str, Any]] = []
    redis_cpu_s = 0.0
    redis_commands = 0
    served = 0
    for run in runs:
        by = _rows(run)
        concs = sorted({n for n, _ in _cells(by, "nonstream")})
        lo, hi = concs[0], concs[-1]
        mid = 32 if 32 in concs else concs[len(concs) // 2]
        ns_mid, ns_hi = _nonstream_cell(by, mid), _nonstream_cell(by, hi)
        c1 = f"nonstream/c{lo}/load.py"
        streams = _cells(by, "stream")
        st = next((c for n, c in streams if n == 32), streams[0][1] if streams else None)
        ours_p50, direct_p50 = (
            _get(by, OURS, c1, "lat_ms", "p50"),
            _get(by, "direct", c1, "lat_ms", "p50"),
        )
        per_run.append(
            {
                "cpu_ms_per_req": _get(by, OURS, ns_mid, "gw_cpu_ms_per_req"),
                "cpu_ms_per_stream": _get(by, OURS, st, "gw_cpu_ms_per_req"),
                "litellm_cpu_ms_per_req": _get(by, "litellm", ns_mid, "gw_cpu_ms_per_req"),
                "nginx_cpu_ms_per_req": _get(by, "nginx", ns_mid, "gw_cpu_ms_per_req"),
                "nginx_cpu_ms_per_stream": _get(by, "nginx", st, "gw_cpu_ms_per_req"),
                "rps_ratio_vs_nginx_c32": _ratio(
                    _get(by, OURS, ns_mid, "rps"), _get(by, "nginx", ns_mid, "rps")
                ),
                "added_p50_ms_c1": (
                    None if ours_p50 is None or direct_p50 is None else ours_p50 - direct_p50
                ),
                "added_p99_ms_c32": _added_p99(by, 32),
                "added_p99_ms_c450": _added_p99(by, 450),
                "errors_c450": sum(
                    int(_get(by, OURS, c, "errors") or 0)
                    for n, c in _cells(by, "nonstream") + streams
                    if n == hi
                ),
                "accept_q_max_c450": _get(by, OURS, ns_hi, "accept_q_max"),
            }
        )
        redis = run / "redis.json"
        if redis.exists():
            r = json.loads(redis.read_text())
            redis_cpu_s += float(r["cpu_s"])
            redis_commands += int(r["commands"])
        served += _usage_requests(run)
    out: dict[str, Any] = {"runs": len(runs)}
    for key in per_run[0]:
        values = [r[key] for r in per_run]
        if key == "errors_c450":
            out[key] = sum(values)
        elif key == "accept_q_max_c450":
            out[key] = max((v for v in values if v is not None), default=None)
        else:
            out[key] = _median(values)
    out["requests_served"] = served  # by our gateway, from its own usage records
    out["redis_commands"] = redis_commands
    out["redis_cpu_ms_per_req"] = round(redis_cpu_s * 1000 / served, 4) if served else None
    out["soak_rss_growth_pct"] = None
    out["soak_errors"] = None
    if soak is not None and soak.exists():
        s = json.loads(soak.read_text())
        out["soak_rss_growth_pct"] = s.get("rss_growth_pct")
        out["soak_errors"] = s.get("errors")
    return out


def _ratio(a: Any, b: Any) -> float | None:
    return round(a / b, 3) if a and b else None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--soak", type=Path, default=None)
    a = p.parse_args()
    print(json.dumps(summarize(a.runs, a.soak)))


if __name__ == "__main__":
    main()
