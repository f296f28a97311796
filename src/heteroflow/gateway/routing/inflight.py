"""Requests in flight per backend, as ``least_connections`` (and ``engine_aware``,
``prefix_affinity``) count them: in this process, or shared by the workers of one host.

``LocalInFlight`` is a plain dict (one gateway process, one event loop: no locks).

``SharedInFlight`` is one table for the workers of ``heteroflow gateway --workers N``
(issue 31), so that N workers balance like one: an anonymous shared memory mapping made
by the supervising parent before it forks, inherited by every worker (and by a worker
restarted in its place). Each worker owns one *column* and only ever writes its own
cells, so no two processes write the same word and no lock is needed; a count is the sum
of the row's columns (a few int32 reads). A backend's row is the 64-bit hash of its base
URL modulo ``slots`` (65,536): two backends whose URLs share a row read each other's
counts too (with 50 backends that happens once in ~50 hosts), which costs balance, never
correctness. A worker that dies leaves its column with the requests it had; the parent
zeroes the column before it hands it to the worker that replaces it (``clear``).
"""

from __future__ import annotations

import mmap
from hashlib import blake2b
from typing import Protocol

DEFAULT_SLOTS = 65_536
_CELL = 4  # int32: no worker holds 2^31 requests in flight


class InFlight(Protocol):
    """What ``Balancer`` reads and writes."""

    def get(self, url: str, default: int, /) -> int:
        """Requests in flight to ``url`` through every worker of this gateway (``default``
        when none: 0; a dict's ``get`` is the one-process table's, at C speed)."""
        ...

    def add(self, url: str, delta: int) -> None:
        """This worker's count for ``url`` changes by ``delta`` (+1 acquire, -1 release)."""
        ...

    def own(self, url: str) -> int:
        """This worker's count alone (what its load report says: the server sums)."""
        ...


class LocalInFlight(dict[str, int]):
    """One process: base_url -> requests in flight (> 0 only)."""

    def add(self, url: str, delta: int) -> None:
        n = self.get(url, 0) + delta
        if n > 0:
            self[url] = n
        else:
            self.pop(url, None)

    def own(self, url: str) -> int:
        return self.get(url, 0)


class SharedInFlight:
    """The workers' table; make it before forking, then ``for_worker`` in each child."""

    __slots__ = ("_cells", "_column", "_columns", "_map", "_rows", "_serving", "_slots")

    def __init__(
        self, columns: int, slots: int = DEFAULT_SLOTS, *, serving: int | None = None
    ) -> None:
        if columns < 1 or slots < 1:
            raise ValueError("columns and slots must be at least 1")
        self._columns = columns
        # how many of the processes take requests at a time (a column each, old and new
        # generations during a restart: half the columns unless said; the server's
        # controllers' process has a column and takes none)
        self._serving = max(1, columns // 2 if serving is None else serving)
        self._slots = slots
        # MAP_SHARED | MAP_ANONYMOUS: shared with the children forked after this; pages
        # are only touched (and backed) for the rows in use.
        self._map = mmap.mmap(-1, columns * slots * _CELL)
        self._cells = memoryview(self._map).cast("i")
        self._column = -1  # the parent writes nothing
        self._rows: dict[str, int] = {}  # base_url -> first cell of its row

    @property
    def columns(self) -> int:
        return self._columns

    @property
    def serving(self) -> int:
        """The processes that take requests (each gates its share of a pool's bound)."""
        return self._serving

    def for_worker(self, column: int) -> SharedInFlight:
        """This process is the worker that owns ``column`` (called in the child)."""
        if not 0 <= column < self._columns:
            raise ValueError(f"column {column} is not in 0..{self._columns - 1}")
        self._column = column
        self._rows = {}
        return self

    def clear(self, column: int) -> None:
        """Zero a dead worker's column (the parent, before the column is reused)."""
        cells, cols = self._cells, self._columns
        for row in range(self._slots):
            i = row * cols + column
            if cells[i]:
                cells[i] = 0

    def _row(self, url: str) -> int:
        row = self._rows.get(url)
        if row is None:
            h = int.from_bytes(blake2b(url.encode(), digest_size=8).digest(), "little")
            row = (h % self._slots) * self._columns
            if len(self._rows) > 10_000:
                self._rows.clear()
            self._rows[url] = row
        return row

    def get(self, url: str, default: int = 0, /) -> int:
        row = self._row(url)
        n = sum(self._cells[row : row + self._columns])
        return n if n > 0 else default

    def add(self, url: str, delta: int) -> None:
        if self._column < 0:
            raise RuntimeError("SharedInFlight.add outside a worker (call for_worker first)")
        i = self._row(url) + self._column
        self._cells[i] += delta

    def own(self, url: str) -> int:
        if self._column < 0:
            return 0
        return self._cells[self._row(url) + self._column]
