"""The collector's settings of a serving process (serving.settle_heap): the start-up heap
frozen, the young generation collected rarely, cyclic garbage still collected."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from heteroflow.schemas.routing import hash_key
from heteroflow.serving import GC_GEN0_THRESHOLD, settle_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def restored_gc() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


@pytest.mark.usefixtures("restored_gc")
def test_settle_heap_freezes_what_lives_and_still_collects_new_cycles() -> None:
    older = _Node()
    gc.set_threshold(700, 7, 9)
    settle_heap()
    assert gc.get_freeze_count() > 0
    assert all(o is not older for o in gc.get_objects())  # no pass walks it again
    assert gc.get_threshold() == (GC_GEN0_THRESHOLD, 7, 9)  # the older ratios kept
    # a cycle made while serving is still found and freed
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    ids = {id(a), id(b)}
    del a, b
    gc.collect()
    assert not ids & {id(o) for o in gc.get_objects() if isinstance(o, _Node)}


# Runs `heteroflow gateway` in this interpreter; right after the process settled its heap
# (the CLI imports settle_heap when it serves), the collector's state is reported and the
# gateway is stopped as an operator would (SIGTERM): no timing involved.
_DRIVER = """
import gc, json, os, signal, sys
from heteroflow import serving
from heteroflow.cli import main

real = serving.settle_heap

def settle_and_report():
    real()
    print(json.dumps({"frozen": gc.get_freeze_count(), "threshold": gc.get_threshold()}),
          flush=True)
    os.kill(os.getpid(), signal.SIGTERM)

serving.settle_heap = settle_and_report
sys.exit(main(sys.argv[1:]))
"""


def test_the_gateway_process_freezes_its_start_up_heap(tmp_path: Path) -> None:
    routes = tmp_path / "routes.json"
    routes.write_text(
        json.dumps(
            {
                "models": {"m": {"backends": ["http://127.0.0.1:9/v1"]}},
                "keys": {"k": {"sha256": hash_key("sk-heap"), "tenant": "t"}},
            }
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER, "gateway", "--routes", str(routes), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    reports = [line for line in lines if line.startswith("{")]
    assert reports, f"the gateway never settled its heap: {proc.stderr[-2000:]}"
    state = json.loads(reports[0])
    # the modules, settings and app of start-up: tens of thousands of objects
    assert state["frozen"] > 10_000
    assert state["threshold"][0] == GC_GEN0_THRESHOLD
    assert any("listening on" in line for line in lines)  # and it served
