"""Every router of the management API commits in its route's thread (issue 26).

A router built with a plain ``APIRouter`` would commit only after FastAPI validated the
answer in another worker thread, holding its locks across the hand-off (see
api/unit_of_work.py); the concurrency tests (tests/integration/test_unique_names.py)
show what that did under load.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from sqlalchemy.orm import Session

import heteroflow.api.routes as routes_package
from heteroflow.api.unit_of_work import UnitOfWorkRoute, api_router


def test_every_router_of_the_api_is_a_unit_of_work_router() -> None:
    names = [m.name for m in pkgutil.iter_modules(routes_package.__path__)]
    assert names
    for name in names:
        module = importlib.import_module(f"{routes_package.__name__}.{name}")
        assert module.router.route_class is UnitOfWorkRoute, name


def _no_session() -> Session:
    raise AssertionError("the test passes the session itself")


def test_a_sync_route_commits_as_it_returns_and_a_stream_is_left_alone() -> None:
    router = api_router()

    @router.post("/write")
    def write(s: Annotated[Session, Depends(_no_session)]) -> dict[str, bool]:
        s.info["used"] = True
        return {"ok": True}

    @router.get("/stream")
    def stream() -> Iterator[bytes]:
        yield b"x"

    by_path = {r.path: r for r in router.routes if isinstance(r, UnitOfWorkRoute)}
    with Session() as s, s.begin():  # a unit of work (no database: the unit tier)
        assert by_path["/write"].dependant.call is not None
        assert by_path["/write"].dependant.call(s=s) == {"ok": True}
        assert s.info["used"] and not s.in_transaction()  # committed in the route's thread
    assert by_path["/stream"].endpoint is stream
