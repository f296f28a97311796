"""Summarise a gateway harness run: our CPU per request and throughput vs the baselines.

Last line: one JSON object (figures, and ratios against nginx / LiteLLM / direct of the
same run).
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(path: str) -> None:
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    by = {(r["target"], r["cell"]): r for r in rows}
    cells = sorted({r["cell"] for r in rows})
    out: dict[str, Any] = {}
    for cell in cells:
        ours = by.get(("heteroflow", cell))
        if not ours:
            continue
        key = cell.replace("/", "_")
        out[f"{key}_heteroflow_cpu_ms_per_req"] = ours.get("gw_cpu_ms_per_req")
        out[f"{key}_heteroflow_rps"] = ours.get("rps")
        for base in ("nginx", "litellm", "direct"):
            b = by.get((base, cell))
            if not b:
                continue
            if base != "direct" and b.get("gw_cpu_ms_per_req") and ours.get("gw_cpu_ms_per_req"):
                out[f"{key}_cpu_ratio_vs_{base}"] = round(
                    ours["gw_cpu_ms_per_req"] / b["gw_cpu_ms_per_req"], 3
                )
            if b.get("rps") and ours.get("rps"):
                out[f"{key}_rps_ratio_vs_{base}"] = round(ours["rps"] / b["rps"], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
