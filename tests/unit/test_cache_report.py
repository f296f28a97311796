"""What the heartbeat says of the node's model cache (issue 29 item 3, H9)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from heteroflow.agent.cache_report import cache_report
from heteroflow.agent.model_cache import CachedModel, ModelCache
from heteroflow.core.clock import FakeClock
from heteroflow.schemas.nodes import MAX_CACHED_MODELS
from heteroflow.settings import AgentSettings

pytestmark = pytest.mark.feature("H9")


class State:
    """The two things ``cache_report`` reads of ``AgentState``: its settings, and the
    cache (made on first use, as the property makes it)."""

    def __init__(self, work_dir: Path, cache: Any = None) -> None:
        self.settings = AgentSettings(work_dir=work_dir)
        self._model_cache = cache
        self.made = False

    @property
    def model_cache(self) -> Any:
        if self._model_cache is None:
            self.made = True
            self._model_cache = ModelCache(self.settings.work_dir / "models", clock=FakeClock())
        return self._model_cache


def test_a_node_that_never_fetched_reports_nothing_and_makes_no_folder(tmp_path: Path) -> None:
    state = State(tmp_path / "agent")
    assert cache_report(state) == []  # type: ignore[arg-type]
    assert not state.made and not (tmp_path / "agent" / "models").exists()


def test_a_complete_model_on_disk_is_reported_with_its_source(tmp_path: Path) -> None:
    folder = tmp_path / "agent" / "models" / "hf--org--tiny--0123456789abcdef"
    folder.mkdir(parents=True)
    (folder / ".heteroflow-model.json").write_text(json.dumps(
        {"manifest": {"source": "hf://org/tiny@main", "revision": "c0ffee"}, "bytes": 42}
    ))
    bad = tmp_path / "agent" / "models" / "url--hand-edited--0123456789abcdef"
    bad.mkdir()  # a marker edited by hand: left out, the heartbeat still goes
    (bad / ".heteroflow-model.json").write_text(json.dumps(
        {"manifest": {"source": "https://u:secret@host/m.gguf"}, "bytes": 1}
    ))
    state = State(tmp_path / "agent")
    got = [m.model_dump() for m in cache_report(state)]  # type: ignore[arg-type]
    assert got == [{"key": folder.name, "source": "hf://org/tiny@main", "revision": "c0ffee",
                    "size_bytes": 42, "state": "complete"}]


class Listed:
    def __init__(self, models: list[CachedModel]) -> None:
        self.models = models

    def list(self) -> list[CachedModel]:
        return self.models


def model(i: int, state: str = "complete") -> CachedModel:
    when = datetime.fromtimestamp(i, UTC) if state == "complete" else None
    return CachedModel(f"url--m{i}--0123456789abcdef", f"https://host/m{i}.gguf", "", i, when,
                       0, state)  # type: ignore[arg-type]


def test_downloads_first_then_the_most_recently_used_up_to_the_cap(tmp_path: Path) -> None:
    # list(): complete ones least recently used first, then the downloads
    listed = [model(i) for i in range(MAX_CACHED_MODELS + 5)] + [model(9999, "downloading")]
    state = State(tmp_path, Listed(listed))
    got = cache_report(state)  # type: ignore[arg-type]
    assert len(got) == MAX_CACHED_MODELS
    assert (got[0].state, got[0].size_bytes) == ("downloading", 9999)
    assert got[1].size_bytes == MAX_CACHED_MODELS + 4  # the most recently used
    assert got[-1].size_bytes == 6  # the least recently used ones are left out
