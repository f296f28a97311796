"""The progress as JSON (``task_groups.rollout_spec``)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from heteroflow.core.rollout.model import Progress, Strategy


def _dt(v: Any) -> datetime | None:
    return datetime.fromisoformat(v) if isinstance(v, str) and v else None


def _iso(v: datetime | None) -> str | None:
    return v.isoformat() if v is not None else None


def progress_to_json(p: Progress) -> dict[str, Any]:
    return {
        "strategy": p.strategy.value,
        "generation": p.generation,
        "from_generation": p.from_generation,
        "batch_size": p.batch_size,
        "rolling_back": p.rolling_back,
        "reason": p.reason,
        "batch": list(p.batch),
        "candidates": {str(k): v for k, v in p.candidates.items()},
        "attempt": p.attempt,
        "batch_since": _iso(p.batch_since),
        "drain_since": _iso(p.drain_since),
        "old_stopped": p.old_stopped,
        "drain": p.drain,
        "given_up": list(p.given_up),
        "retiring": {k: v.isoformat() for k, v in p.retiring.items()},
        "batches_done": p.batches_done,
        "progress_at": _iso(p.progress_at),
        "prepull_image": p.prepull_image,
        "prepulled": p.prepulled,
        "gang": p.gang,
    }


def progress_from_json(d: Mapping[str, Any]) -> Progress:
    return Progress(
        strategy=Strategy(d["strategy"]),
        generation=int(d["generation"]),
        from_generation=int(d["from_generation"]),
        batch_size=int(d.get("batch_size", 1)),
        rolling_back=bool(d.get("rolling_back", False)),
        reason=str(d.get("reason", "")),
        batch=tuple(int(x) for x in d.get("batch", ())),
        candidates={int(k): str(v) for k, v in (d.get("candidates") or {}).items()},
        attempt=int(d.get("attempt", 1)),
        batch_since=_dt(d.get("batch_since")),
        drain_since=_dt(d.get("drain_since")),
        old_stopped=bool(d.get("old_stopped", False)),
        drain=bool(d.get("drain", True)),
        given_up=tuple(int(x) for x in d.get("given_up", ())),
        retiring={
            str(k): dt for k, v in (d.get("retiring") or {}).items()
            if (dt := _dt(v)) is not None
        },
        batches_done=int(d.get("batches_done", 0)),
        progress_at=_dt(d.get("progress_at")),
        prepull_image=str(d.get("prepull_image", "")),
        prepulled=bool(d.get("prepulled", False)),
        gang=bool(d.get("gang", False)),
    )
