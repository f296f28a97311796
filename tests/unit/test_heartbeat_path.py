"""The heartbeat's hot path, its pure parts (issue 18, item 3): which columns a beat
writes (``services.nodes``). The answers of the fast path against the declared route:
tests/integration/test_heartbeat_writes.py and test_heartbeat_fast.py."""

from __future__ import annotations

import json
from typing import Any

from heteroflow.schemas.nodes import Heartbeat
from heteroflow.services.agents.nodes import STEADY_COLUMNS, changed_columns, reported_columns

CARD = {"index": 0, "memory_total_mb": 24000, "memory_used_mb": 10, "temperature_c": 40}
BODY: dict[str, Any] = {
    "name": "n1",
    "address": "10.0.0.1",
    "inventory": {"gpus": [CARD], "cpu_count": 8, "memory_total_mb": 65536},
    "labels": {"zone": "a"},
    "models": [{"name": "m", "path": "/data/models/m", "files": ["a.gguf"]}],
    "host_ports_in_use": [9100, 22, 9100],
}
JSON = "application/json"


def test_reported_columns_are_the_stored_form_of_the_beat() -> None:
    cols = reported_columns(Heartbeat.model_validate(BODY))
    assert cols["host_ports_in_use"] == [22, 9100]  # sorted, each once
    assert cols["gpus"][0]["index"] == 0 and cols["gpus"][0]["temperature_c"] == 40
    assert cols["models"][0]["files"] == ["a.gguf"]
    assert (cols["labels"], cols["engines"], cols["runtime"]) == ({"zone": "a"}, {}, "process")
    assert set(STEADY_COLUMNS) < set(cols)
    json.dumps(cols)  # plain JSON types, as the columns hold them


def test_only_what_changed_is_written() -> None:
    cols = reported_columns(Heartbeat.model_validate(BODY))
    all_same = dict.fromkeys(STEADY_COLUMNS, True)
    written = changed_columns(cols, cols["gpus"], all_same)
    assert set(written) == set(cols) - {*STEADY_COLUMNS, "gpus"}
    assert written["address"] == "10.0.0.1"  # the small columns are always written
    moved = [{**cols["gpus"][0], "temperature_c": 41}]
    assert "gpus" in changed_columns(cols, moved, all_same)
    some = {**all_same, "models": False}
    assert set(changed_columns(cols, cols["gpus"], some)) & set(STEADY_COLUMNS) == {"models"}
    # a steady column the comparison says nothing about is written
    assert set(STEADY_COLUMNS) <= set(changed_columns(cols, cols["gpus"], {}))
