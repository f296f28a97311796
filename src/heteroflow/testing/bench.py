"""What the benchmarks under bench/ share: a throw-away PostgreSQL database and
nearest-rank percentiles (bench/scheduler.py, bench/control_plane.py)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

ADMIN_URL = os.environ.get(
    "HETEROFLOW_BENCH_PG",
    os.environ.get("HETEROFLOW_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres"),
)


@contextmanager
def fresh_database(admin_url: str = ADMIN_URL) -> Iterator[str]:
    """CREATE DATABASE hf_bench_<random>; yields its URL; dropped on the way out."""
    admin = psycopg.connect(admin_url, autocommit=True, connect_timeout=5)
    name = f"hf_bench_{secrets.token_hex(4)}"
    admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"{admin_url.rsplit('/', 1)[0]}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]
