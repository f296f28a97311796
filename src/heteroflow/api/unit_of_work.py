"""A sync route commits its unit of work in its own worker thread (issue 26).

FastAPI runs a sync route in a worker thread, validates the answer in a second
worker-thread call, and only then ends the function-scoped ``DB`` dependency (the
commit, api/deps.py). Whatever the unit of work had locked — a tenant's row
(``quotas.lock_tenant``), SQLite's write lock — stayed held across that hand-off. With
as many requests waiting on the lock, or on a pooled connection those hold, as the
thread pool has threads (40), the holder never got a thread back to validate its answer
and commit: every request stalled until the database's lock timeout (30 s) and most
answered 500 (fifty parallel creates of one service did).

Every router of the API is an ``api_router``: its sync routes commit their session as
they return, before the thread is given back, so no request waits on a lock whose
holder waits for a thread. A 2xx still means committed; the dependency's exit then finds
the transaction closed, and an error raised by the route still rolls everything back
there. Generator routes (streams) open their own sessions and are left as they are.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter
from fastapi.routing import APIRoute
from sqlalchemy.orm import Session


class UnitOfWorkRoute(APIRoute):
    """An ``APIRoute`` whose sync endpoint commits its session(s) as it returns."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        plain = not (
            inspect.iscoroutinefunction(endpoint)
            or inspect.isgeneratorfunction(endpoint)
            or inspect.isasyncgenfunction(endpoint)
        )
        super().__init__(path, _committed(endpoint) if plain else endpoint, **kwargs)


def api_router(**kwargs: Any) -> APIRouter:
    """An ``APIRouter`` of ``UnitOfWorkRoute`` routes (every router of the API)."""
    return APIRouter(route_class=UnitOfWorkRoute, **kwargs)


def _committed(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(endpoint)  # FastAPI reads the parameters through __wrapped__
    def run(*args: Any, **kwargs: Any) -> Any:
        answer = endpoint(*args, **kwargs)
        for value in kwargs.values():
            if isinstance(value, Session) and value.in_transaction():
                value.commit()
        return answer

    return run
