"""Header-only GGUF files for the tests that read a model's metadata (the estimate, the
dry run, the chat-template rule): the architecture and the fields asked for, one small
tensor, no weights worth loading."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def header_gguf(
    path: Path,
    arch: str,
    *,
    context: int = 32768,
    blocks: int | None = None,
    heads: int | None = None,
    kv_heads: int | None = None,
    key_value_length: int | None = None,
    embedding: int | None = None,
) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    if blocks is not None:
        writer.add_block_count(blocks)
    if heads is not None:
        writer.add_head_count(heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads)
    if key_value_length is not None:
        writer.add_key_length(key_value_length)
        writer.add_value_length(key_value_length)
    if embedding is not None:
        writer.add_embedding_length(embedding)
    writer.add_context_length(context)
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
