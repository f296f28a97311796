"""GPU memory estimate of model paths on disk (B8): HF directories, GGUF files, shards."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from heteroflow.core.estimate import MIB, estimate_gguf_meta, estimate_hf
from heteroflow.models.estimate import (
    estimate_model_path,
    gguf_shards,
    read_gguf_meta,
    weight_files,
)
from heteroflow.models.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.feature("B8")

CONFIG: dict[str, Any] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
}


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes (almost) no disk space."""
    with path.open("wb") as f:
        f.truncate(size)
    return path


def hf_dir(root: Path, config: dict[str, Any] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(CONFIG if config is None else config))
    return root


def write_gguf(
    path: Path,
    *,
    arch: str = "qwen2",
    block_count: int = 24,
    head_count: int = 14,
    head_count_kv: int | Sequence[int] = 2,
    embedding_length: int = 896,
    context_length: int | None = 32768,
    key_value_length: tuple[int, int] | None = None,
) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(block_count)
    writer.add_head_count(head_count)
    writer.add_head_count_kv(head_count_kv)
    writer.add_embedding_length(embedding_length)
    if context_length is not None:
        writer.add_context_length(context_length)
    if key_value_length is not None:
        writer.add_key_length(key_value_length[0])
        writer.add_value_length(key_value_length[1])
    writer.add_token_list([f"t{i}" for i in range(5000)])  # a vocabulary-sized string array
    writer.add_token_scores([0.0] * 5000)  # a long numeric array
    writer.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---------------------------------------------------------------- Hugging Face directories


def test_hf_dir_sums_safetensors_shards(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "qwen")
    sizes = [3 * MIB + 17, 2 * MIB]
    for i, size in enumerate(sizes, 1):
        sparse(model / f"model-0000{i}-of-00002.safetensors", size)
    (model / "tokenizer.json").write_text("{}")
    est = estimate_model_path(model)
    assert est == estimate_hf(CONFIG, weights_bytes=sum(sizes))
    assert est is not None and est.weights_mb == math.ceil(sum(sizes) / MIB) == 6
    assert est.source == "hf-config" and "(weight files)" in est.detail
    assert est.kv_cache_mb == 2 * 24 * 2 * 64 * 2 * 32768 // MIB == 384


def test_hf_dir_prefers_safetensors_and_follows_the_index(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "mistral")
    a = sparse(model / "model-00001-of-00002.safetensors", 5 * MIB)
    b = sparse(model / "model-00002-of-00002.safetensors", 4 * MIB)
    sparse(model / "consolidated.safetensors", 9 * MIB)  # the same weights, original format
    sparse(model / "pytorch_model.bin", 9 * MIB)  # and a .bin copy
    assert weight_files(model) == [a, b]  # HF shards win over consolidated, without an index
    index = {"weight_map": {"x": "model-00001-of-00002.safetensors",
                            "y": "model-00001-of-00002.safetensors"}}  # fmt: skip
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    assert weight_files(model) == [a]
    est = estimate_model_path(model, context_tokens=1024)
    assert est == estimate_hf(CONFIG, weights_bytes=5 * MIB, context_tokens=1024)


def test_hf_dir_bin_weights_skip_training_state(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "old")
    sparse(model / "pytorch_model.bin", 7 * MIB)
    sparse(model / "training_args.bin", 5000)
    sparse(model / "optimizer.pt", 14 * MIB)
    assert [p.name for p in weight_files(model)] == ["pytorch_model.bin"]
    est = estimate_model_path(model)
    assert est is not None and est.weights_mb == 7


def test_hf_dir_without_weights_counts_parameters(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "config-only")
    assert weight_files(model) == []
    assert estimate_model_path(model) == estimate_hf(CONFIG)


def test_hf_dir_with_bad_config_is_skipped(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    assert estimate_model_path(broken) is None
    assert estimate_model_path(hf_dir(tmp_path / "list", [1, 2])) is None  # type: ignore[arg-type]
    lacking = {k: v for k, v in CONFIG.items() if k != "num_hidden_layers"}
    assert estimate_model_path(hf_dir(tmp_path / "lacking", lacking)) is None


# ---------------------------------------------------------------- GGUF files


def reference_meta(path: Path) -> dict[str, Any]:
    """What gguf.GGUFReader decodes, restricted to what read_gguf_meta keeps."""
    reader = gguf.GGUFReader(path)
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue  # the header counts, not key/values
        is_array = field.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and (field.types[-1] == gguf.GGUFValueType.STRING or len(field.data) > 4096):
            continue
        meta[name] = field.contents()
    return meta


def test_read_gguf_meta_agrees_with_gguf_reader(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    hybrid = write_gguf(tmp_path / "hybrid.gguf", block_count=4, head_count_kv=[4, 0, 4, 0])
    for path in (tiny, hybrid):
        meta = read_gguf_meta(path)
        assert meta == reference_meta(path)
    assert read_gguf_meta(tiny)["tokenizer.ggml.add_bos_token"] is True
    assert len(read_gguf_meta(tiny)["tokenizer.ggml.scores"]) == 261  # short arrays are kept


def test_read_gguf_meta_rejects_truncated_and_foreign_files(tmp_path: Path) -> None:
    data = write_tiny_gguf(tmp_path / "tiny.gguf").read_bytes()
    for size in (0, 10, 30, 200, 2000):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ValueError):
            read_gguf_meta(cut)
        assert estimate_model_path(cut) is None
    (tmp_path / "json.gguf").write_text('{"model": "this is JSON, not a GGUF header"}')
    with pytest.raises(ValueError, match="not a little-endian GGUF"):
        read_gguf_meta(tmp_path / "json.gguf")


def test_tiny_gguf(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    meta = read_gguf_meta(path)
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 2 and meta["llama.context_length"] == 2048
    assert "tokenizer.ggml.tokens" not in meta  # string arrays are skipped
    assert isinstance(meta["tokenizer.chat_template"], str)
    est = estimate_model_path(path)
    assert est is not None and est.source == "gguf"
    assert est.weights_mb == math.ceil(path.stat().st_size / MIB)
    # 2 layers x 2 x 4 kv-heads x (64 / 4) dim x 2 B x 2048 tokens = 0.5 MiB
    assert est.kv_cache_mb == 1 and est.context_tokens == 2048
    assert est.overhead_mb == 513
    assert estimate_model_path(tmp_path) == est  # a directory resolves to its GGUF


def test_hand_written_gguf_metadata(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "qwen.gguf", context_length=131072)
    meta = read_gguf_meta(path)
    assert meta["qwen2.attention.head_count_kv"] == 2
    assert "tokenizer.ggml.scores" not in meta  # 5000 > 4096: vocabulary-sized, skipped
    est = estimate_model_path(path)
    assert est is not None
    assert est.context_tokens == 32768  # 131072 capped
    assert est.kv_cache_mb == 2 * 24 * 2 * 64 * 2 * 32768 // MIB == 384
    assert est.weights_mb == math.ceil(path.stat().st_size / MIB)
    assert "KV 24 layers x 2 x 2 kv-heads x 64 dim x 2 B x 32768 tokens" in est.detail
    override = estimate_model_path(path, context_tokens=8192)
    assert override is not None and override.kv_cache_mb == 96


def test_gguf_per_layer_kv_heads_and_key_lengths(tmp_path: Path) -> None:
    path = write_gguf(
        tmp_path / "hybrid.gguf", block_count=4, head_count_kv=[4, 0, 4, 0],
        context_length=4096, key_value_length=(192, 128),
    )  # fmt: skip
    meta = read_gguf_meta(path)
    assert meta["qwen2.attention.head_count_kv"] == [4, 0, 4, 0]
    est = estimate_model_path(path)
    assert est is not None
    assert est.kv_cache_mb == math.ceil(8 * (192 + 128) * 2 * 4096 / MIB)


def test_sharded_gguf_sums_all_shards(tmp_path: Path) -> None:
    first = write_gguf(tmp_path / "big-00001-of-00003.gguf")
    second = sparse(tmp_path / "big-00002-of-00003.gguf", 40 * MIB)
    third = sparse(tmp_path / "big-00003-of-00003.gguf", 30 * MIB)
    sparse(tmp_path / "mmproj-big-f16.gguf", 5 * MIB)  # a vision projector, not the model
    assert gguf_shards(third) == [first, second, third]
    total = sum(p.stat().st_size for p in (first, second, third))
    expected = estimate_gguf_meta(read_gguf_meta(first), file_bytes=total)
    assert estimate_model_path(first) == expected
    assert estimate_model_path(second) == expected  # any shard names the whole model
    assert estimate_model_path(tmp_path) == expected  # the directory resolves to shard 1
    third.unlink()
    assert estimate_model_path(first) is None  # incomplete model: skip the precheck


def test_gguf_without_needed_metadata_is_skipped(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "bare.gguf", "llama")
    writer.add_tensor("x", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert estimate_model_path(tmp_path / "bare.gguf") is None
    no_ctx = write_gguf(tmp_path / "noctx.gguf", context_length=None)
    assert estimate_model_path(no_ctx) is None
    assert estimate_model_path(no_ctx, context_tokens=2048) is not None


def test_unknown_paths_give_none(tmp_path: Path) -> None:
    assert estimate_model_path(tmp_path / "missing") is None
    assert estimate_model_path(tmp_path / "missing.gguf") is None
    assert estimate_model_path(tmp_path) is None  # an empty directory
    (tmp_path / "notes.txt").write_text("hello")
    assert estimate_model_path(tmp_path / "notes.txt") is None
    assert estimate_model_path(tmp_path) is None
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")
    assert estimate_model_path(tmp_path / "fake.gguf") is None
    assert estimate_model_path(tmp_path) is None  # the directory's only GGUF is unreadable
    assert estimate_model_path(Path("relative/name/that/does/not/exist")) is None


def test_dir_with_config_but_only_gguf_weights_uses_the_gguf(tmp_path: Path) -> None:
    model = hf_dir(tmp_path / "gguf-repo")  # some GGUF repos ship the original config.json
    gguf_file = write_gguf(model / "model-q4_k_m.gguf")
    assert estimate_model_path(model) == estimate_model_path(gguf_file)
    est = estimate_model_path(model)
    assert est is not None and est.source == "gguf"
    sparse(model / "model.safetensors", 3 * MIB)  # with HF weights, the HF estimate wins
    assert estimate_model_path(model) == estimate_hf(CONFIG, weights_bytes=3 * MIB)
