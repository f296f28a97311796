"""HeteroFlow's gateway in the shared benchmark's gateway slot, as deployed at the edge.

Writes a routing file — one key (by sha256), model ``fake-model`` routed to ``--upstream``
(the harness's fake backend) with ``least_connections``, RPM and TPM limits on the key
(high enough never to refuse: the bench measures their cost, not refusals) — and execs
``heteroflow gateway --routes FILE --usage-log FILE``: the production standalone gateway
with key auth, limits (Redis-backed when ``HETEROFLOW_REDIS_URL`` is set), usage
accounting and least_connections all on.

    python bench/gateway_slot.py --port 18090 --upstream http://127.0.0.1:18000/v1 \\
        --key sk-bench --workdir bench/results/run-x
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from heteroflow.schemas.routing import hash_key

NEVER_REFUSING_RPM = 1_000_000_000
NEVER_REFUSING_TPM = 1_000_000_000_000


def routes_file(upstream: str, key: str, model: str) -> dict[str, object]:
    return {
        "models": {model: {"algorithm": "least_connections", "backends": [upstream]}},
        "keys": {
            "bench": {
                "sha256": hash_key(key),
                "tenant": "bench",
                "rpm_limit": NEVER_REFUSING_RPM,
                "tpm_limit": NEVER_REFUSING_TPM,
            }
        },
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", required=True, help="backend base URL (with or without /v1)")
    p.add_argument("--key", required=True)
    p.add_argument("--model", default="fake-model")
    p.add_argument("--workdir", required=True, help="routes.json and usage.jsonl go here")
    a = p.parse_args()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    routes = work / "routes.json"
    routes.write_text(json.dumps(routes_file(a.upstream, a.key, a.model), indent=2))
    argv = [
        sys.executable,
        "-m",
        "heteroflow.cli",
        "gateway",
        "--routes",
        str(routes),
        "--usage-log",
        str(work / "usage.jsonl"),
        "--host",
        "127.0.0.1",
        "--port",
        str(a.port),
    ]
    # exec: the harness measures (and stops) this very process
    os.execv(sys.executable, argv)  # noqa: S606 - fixed argv, no shell


if __name__ == "__main__":
    main()
