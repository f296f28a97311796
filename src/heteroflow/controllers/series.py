"""The live series' sampler (issue 33): leader-only, fenced, every ``series_interval_s``.

A round reads what the server holds (the gateways' load reports, the nodes' last
heartbeats, the tasks: ``services/series/sampler.py``), writes one point per series
and deletes the points past their window (``services/series/store.py``), in one fenced
transaction. Leader-only: two instances would write every point twice (the raw point
would be the same, but the minute's running mean would count each sample twice); the
rates' previous counters live in the leader's memory, so a new leader's first sample
has no rates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from heteroflow.controllers.base import FencedController, Round
from heteroflow.services.series import store
from heteroflow.services.series.sampler import Sampler


@dataclass(eq=False, kw_only=True)
class SeriesSampler(FencedController[int]):
    """A round answers how many series it sampled."""

    name = "series"
    skipped = "series sample"

    load_stale_s: float
    offline_after_s: float
    sampler: Sampler = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.load_stale_s, self.offline_after_s)

    def round(self, r: Round) -> int:
        with r.transaction() as s:
            n = store.write(s, r.now, self.sampler.sample(s, r.now))
            store.prune(s, r.now)
        return n
