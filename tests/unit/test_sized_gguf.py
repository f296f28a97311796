"""The widened tiny model (bench/cold_start.py's big GGUF): its size is what was asked,
its header says the width it was written with, and a second call keeps the file."""

from __future__ import annotations

from pathlib import Path

import gguf

from heteroflow.models.tiny_gguf import write_sized_gguf, write_tiny_gguf


def test_a_sized_model_has_the_asked_size_and_says_its_width(tmp_path: Path) -> None:
    path = write_sized_gguf(tmp_path / "big.gguf", 8)
    size = path.stat().st_size
    assert 7_500_000 < size < 8_600_000
    assert size > 10 * write_tiny_gguf(tmp_path / "tiny.gguf").stat().st_size
    reader = gguf.GGUFReader(path)
    field = reader.fields["llama.feed_forward_length"]
    n_ff = int(field.parts[field.data[0]][0])
    up = next(t for t in reader.tensors if t.name == "blk.0.ffn_up.weight")
    assert sorted(int(d) for d in up.shape) == [64, n_ff]
    mtime = path.stat().st_mtime_ns
    assert write_sized_gguf(path, 8) == path and path.stat().st_mtime_ns == mtime
