"""Names the API keeps unique: the database decides, the loser of a race gets 409.

A create (or rename) reads first, to answer a clear 409 in the common case; but two
requests for one name at once both pass that read. The unique constraint or index in
the database lets only one of them commit: ``taken_as`` turns the other's unique
violation into the ``Conflict`` naming the field, so its whole unit of work rolls back
(nothing half-written: a task group, its tasks, route and endpoint go together or not at
all) and the caller gets 409, never a 500.

No savepoint: after the violation the unit of work is over (the error ends it), and a
savepoint opened outside a transaction on SQLite (pysqlite begins one only before a
write) would commit at its release, splitting the unit of work in two.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from heteroflow.core.errors import Conflict

PG_UNIQUE_VIOLATION = "23505"
SQLITE_UNIQUE = "SQLITE_CONSTRAINT_UNIQUE"


def is_unique_violation(exc: IntegrityError) -> bool:
    """A unique constraint or index refused the write (a foreign key or NOT NULL
    violation is not one: those stay errors)."""
    orig = exc.orig
    return (
        getattr(orig, "sqlstate", None) == PG_UNIQUE_VIOLATION
        or getattr(orig, "sqlite_errorname", None) == SQLITE_UNIQUE
    )


@contextmanager
def taken_as(s: Session, conflict: Conflict) -> Iterator[None]:
    """Write the block's rows now (flush); a unique violation raises ``conflict``.

    The block should write one unique name (the conflict says which); what it wrote, and
    everything before it in the unit of work, is rolled back with the error.
    """
    try:
        yield
        s.flush()
    except IntegrityError as exc:
        if not is_unique_violation(exc):
            raise
        raise conflict from None
