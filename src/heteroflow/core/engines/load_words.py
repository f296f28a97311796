"""What each engine family says about its own model load (FEATURES D5), pure.

The agent judges a load by what moves (``core.loading``): the bytes read and the log are
the same for every engine; what an engine says in its own words differs, and lives here
behind one Protocol (``LoadWords``), one entry per family in ``LOAD_WORDS``. Adding an
engine's words is a class with two methods and one line in the table.

* llama.cpp's server answers its health route ``503 {"error": {"message": "Loading
  model"}}`` while it loads (the stock ``llama-server`` and the xllamacpp launcher both,
  measured); its log has no countable progress (a row of dots).
* vLLM answers nothing until it is ready (connection refused) and logs its weights as a
  tqdm bar with a fixed format (vLLM's ``model_executor/model_loader/weight_utils.py``
  ``_BAR_FORMAT``: ``"{desc}: {percentage:3.0f}% Completed | {n_fmt}/{total_fmt} [...]"``,
  desc ``Loading safetensors checkpoint shards`` or its pt / np_cache / eager variants);
  ``Starting to load model`` opens the load and ``Model loading took ... seconds`` (or
  ``Loading weights took``) ends the weights. SGLang reuses the same loader bar and ends
  with ``Load weight end``.
* Any other engine says nothing of its own: bytes and log only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Protocol

_SHARDS = re.compile(
    r"checkpoint shards[^:\r\n]*:\s*\d+% Completed \| (\d+)/(\d+)", re.IGNORECASE
)
_VLLM_START = re.compile(r"Starting to load model")
_VLLM_DONE = re.compile(r"Model loading took|Loading weights took|Load weight end")


class LoadWords(Protocol):
    """One engine family's own words about its load."""

    def fraction(self, log_tail: str) -> float | None:
        """The share of its weights loaded (0..1) by the latest of its log lines here,
        None when they say nothing about it."""
        ...

    def says_loading(self, health_detail: str) -> bool:
        """Whether its health answer (``HTTP 503: Loading model``) says it is loading."""
        ...


class Silent:
    """An engine with no words of its own: the bytes read and the log decide."""

    def fraction(self, log_tail: str) -> float | None:
        return None

    def says_loading(self, health_detail: str) -> bool:
        return False


class LlamaCppWords(Silent):
    """llama.cpp: ``503 Loading model`` from its health route while it loads."""

    def says_loading(self, health_detail: str) -> bool:
        return health_detail.startswith("HTTP 503") and "loading model" in health_detail.lower()


class VllmWords(Silent):
    """vLLM and SGLang: the loader's shard bar, its start and its end lines."""

    def fraction(self, log_tail: str) -> float | None:
        best: tuple[int, float] | None = None  # (position in the tail, fraction)
        for m in _SHARDS.finditer(log_tail):
            done, total = int(m.group(1)), int(m.group(2))
            if total > 0:
                best = (m.start(), min(done / total, 1.0))
        for pattern, value in ((_VLLM_START, 0.0), (_VLLM_DONE, 1.0)):
            for m in pattern.finditer(log_tail):
                if best is None or m.start() > best[0]:
                    best = (m.start(), value)
        return None if best is None else best[1]


SILENT = Silent()
LOAD_WORDS: Mapping[str, LoadWords] = {
    "llamacpp": LlamaCppWords(),
    "vllm": VllmWords(),
    "vllm-mtt": VllmWords(),
    "sglang": VllmWords(),
}


def words_for(engine: str) -> LoadWords:
    """The engine family's words (``SILENT`` for one that has none)."""
    return LOAD_WORDS.get(engine, SILENT)
