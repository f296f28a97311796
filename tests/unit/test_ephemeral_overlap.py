"""The port pool against the kernel's ephemeral range (P2): a port an outgoing connection
holds refuses an engine although nothing listens there, so `up` warns of a pool there."""

from __future__ import annotations

from pathlib import Path

import pytest

from heteroflow.core.ports import ephemeral_overlap, local_ephemeral_range


@pytest.mark.feature("P2")
def test_the_part_of_the_pool_inside_the_ephemeral_range_is_named() -> None:
    linux = (32768, 60999)
    assert ephemeral_overlap(range(20000, 30000), linux) is None  # the default pool
    assert ephemeral_overlap(range(30000, 40001), linux) == range(32768, 40001)
    assert ephemeral_overlap(range(60000, 65536), linux) == range(60000, 61000)
    assert ephemeral_overlap(range(32768, 32769), linux) == range(32768, 32769)
    assert ephemeral_overlap(range(61000, 62000), linux) is None
    assert ephemeral_overlap(range(30000, 40000), None) is None  # not Linux


def test_the_range_is_read_from_the_kernel_file(tmp_path: Path) -> None:
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert local_ephemeral_range(str(f)) == (32768, 60999)
    f.write_text("garbage\n")
    assert local_ephemeral_range(str(f)) is None
    assert local_ephemeral_range(str(tmp_path / "missing")) is None
