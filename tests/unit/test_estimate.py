"""GPU memory estimate math (B8): parameter counts, KV cache, context cap, overhead, errors."""

from __future__ import annotations

import math
from typing import Any

import pytest

from heteroflow.core.estimate import (
    DEFAULT_CONTEXT_CAP,
    MIB,
    MemoryEstimate,
    estimate_gguf_meta,
    estimate_hf,
    overhead_mb,
)

pytestmark = pytest.mark.feature("B8")

# Qwen2.5-7B-Instruct's config.json (the keys the estimate reads).
QWEN7B: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "max_position_embeddings": 32768,
}


def qwen(**overrides: Any) -> dict[str, Any]:
    return {**QWEN7B, **overrides}


def qwen7b_params() -> int:
    h, i, layers, vocab, kv_dim = 3584, 18944, 28, 152064, 4 * 128
    embeddings = 2 * vocab * h  # embed_tokens + untied lm_head
    attention = h * h + 2 * h * kv_dim + h * h  # q, k, v, o
    mlp = 3 * h * i  # gate, up, down
    return embeddings + layers * (attention + mlp + 2 * h) + h


def check_sums(est: MemoryEstimate) -> None:
    assert est.total_mb == est.weights_mb + est.kv_cache_mb + est.overhead_mb
    assert abs(est.overhead_mb - (512 + est.weights_mb * 0.05)) <= 1


def test_dense_qwen_7b_by_hand() -> None:
    est = estimate_hf(QWEN7B)
    params = qwen7b_params()
    assert params == 7_615_487_488  # Qwen reports 7.61B (its q/k/v biases add 0.13M)
    weights_bytes = params * 2
    kv_bytes = 2 * 28 * 4 * 128 * 2 * 32768
    assert est.weights_mb == math.ceil(weights_bytes / MIB) == 14526
    assert est.kv_cache_mb == kv_bytes // MIB == 1792
    assert est.overhead_mb == 512 + math.ceil(weights_bytes * 0.05 / MIB) == 1239
    assert est.total_mb == 14526 + 1792 + 1239
    assert est.context_tokens == 32768
    assert est.source == "hf-config"
    check_sums(est)


def test_detail_names_the_numbers() -> None:
    detail = estimate_hf(QWEN7B).detail
    for part in ("7.6B params", "2 B (bfloat16)", "14.2 GiB weights", "28 layers", "2 x 4 kv-heads",
                 "128 dim", "32768 tokens", "1.8 GiB", "overhead 1.2 GiB", "17.1 GiB"):
        assert part in detail, (part, detail)
    assert "\n" not in detail


def test_gqa_caches_less_than_mha() -> None:
    gqa = estimate_hf(QWEN7B)
    mha = estimate_hf(qwen(num_key_value_heads=28))
    assert mha.kv_cache_mb == 7 * gqa.kv_cache_mb
    no_key = {k: v for k, v in QWEN7B.items() if k != "num_key_value_heads"}
    assert estimate_hf(no_key).kv_cache_mb == mha.kv_cache_mb  # absent = MHA (HF default)
    # MHA also has bigger k/v projections: 2 x hidden x (28 - 4) x 128 more params per layer.
    extra = 28 * 2 * 3584 * (28 - 4) * 128 * 2
    assert abs((mha.weights_mb - gqa.weights_mb) * MIB - extra) < MIB


def test_explicit_head_dim_and_kv_dtype() -> None:
    est = estimate_hf(qwen(head_dim=256), kv_dtype_bytes=1)
    assert est.kv_cache_mb == 2 * 28 * 4 * 256 * 1 * 32768 // MIB


def test_tied_embeddings_count_once() -> None:
    untied = estimate_hf(QWEN7B)
    tied = estimate_hf(qwen(tie_word_embeddings=True))
    assert abs((untied.weights_mb - tied.weights_mb) * MIB - 152064 * 3584 * 2) < MIB


@pytest.mark.parametrize(
    ("dtype", "nbytes"), [("float32", 4), ("float16", 2), ("torch.bfloat16", 2), (None, 2)]
)
def test_dtype_bytes(dtype: str | None, nbytes: int) -> None:
    est = estimate_hf(qwen(torch_dtype=dtype))
    assert est.weights_mb == math.ceil(qwen7b_params() * nbytes / MIB)
    assert estimate_hf({**qwen(torch_dtype=None), "dtype": dtype}).weights_mb == est.weights_mb


def test_mixtral_moe_counts_all_experts() -> None:
    cfg = {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "vocab_size": 32000, "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768,
    }  # fmt: skip
    h, layer_attn = 4096, 2 * 4096 * 4096 + 2 * 4096 * 1024
    per_layer = layer_attn + 8 * 3 * h * 14336 + h * 8 + 2 * h
    params = 2 * 32000 * h + 32 * per_layer + h
    est = estimate_hf(cfg)
    assert est.weights_mb == math.ceil(params * 2 / MIB)
    assert "46.7B params" in est.detail  # Mixtral-8x7B: 46.7B total
    assert est.kv_cache_mb == 2 * 32 * 8 * 128 * 2 * 32768 // MIB


def test_deepseek_v3_moe_with_latent_attention() -> None:
    cfg = {
        "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
        "n_routed_experts": 256, "n_shared_experts": 1, "first_k_dense_replace": 3,
        "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "max_position_embeddings": 163840,
    }  # fmt: skip
    est = estimate_hf(cfg)
    # 671B total (DeepSeek-V3's model card, without the 14B multi-token-prediction module).
    assert "671.0B params" in est.detail
    # MLA caches one 512 + 64 latent per layer and token, not K and V per head.
    assert est.kv_cache_mb == 61 * (512 + 64) * 2 * DEFAULT_CONTEXT_CAP // MIB
    assert "(512 latent + 64 rope)" in est.detail


def test_qwen3_moe_dense_layers_and_shared_expert() -> None:
    base = {
        "hidden_size": 1024, "intermediate_size": 4096, "moe_intermediate_size": 256,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "num_experts": 16, "vocab_size": 1000, "tie_word_embeddings": True,
        "torch_dtype": "float32", "max_position_embeddings": 4096,
    }  # fmt: skip
    h = 1024
    attn = 2 * h * h + 2 * h * 256 + 2 * h
    moe = 16 * 3 * h * 256 + h * 16
    dense = 3 * h * 4096
    expected = 1000 * h + 4 * attn + h + 3 * moe + dense  # layer 1 is dense (mlp_only_layers)
    est = estimate_hf({**base, "mlp_only_layers": [1]})
    assert est.weights_mb == math.ceil(expected * 4 / MIB)
    shared = estimate_hf({**base, "mlp_only_layers": [1], "shared_expert_intermediate_size": 512})
    assert abs((shared.weights_mb - est.weights_mb) * MIB - 3 * 3 * h * 512 * 4) < MIB


def test_nested_text_config_matches_flat() -> None:
    wrapped = {
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": QWEN7B,
        "vision_config": {"hidden_size": 1024, "num_hidden_layers": 24},
    }
    assert estimate_hf(wrapped) == estimate_hf(QWEN7B)


def test_quantization_bits_shrink_layers_not_embeddings() -> None:
    gptq = qwen(torch_dtype="float16", quantization_config={"quant_method": "gptq", "bits": 4})
    est = estimate_hf(gptq)
    embed = 2 * 152064 * 3584
    body = qwen7b_params() - embed
    assert est.weights_mb == math.ceil((body * 0.5 + embed * 2) / MIB)
    assert "4 bit (gptq)" in est.detail
    fp8 = estimate_hf(qwen(quantization_config={"quant_method": "fp8"}))
    assert fp8.weights_mb == math.ceil((body * 1 + embed * 2) / MIB)
    bnb = estimate_hf(qwen(quantization_config={"quant_method": "bitsandbytes",
                                                "load_in_4bit": True}))
    assert bnb.weights_mb == est.weights_mb
    assert estimate_hf(qwen(quantization_config={})).weights_mb == estimate_hf(QWEN7B).weights_mb


def test_weights_bytes_wins_and_needs_no_param_keys() -> None:
    est = estimate_hf(QWEN7B, weights_bytes=15_231_233_024)
    assert est.weights_mb == math.ceil(15_231_233_024 / MIB)
    assert est.kv_cache_mb == 1792
    assert "(weight files)" in est.detail
    bare = {k: v for k, v in QWEN7B.items() if k not in ("intermediate_size", "vocab_size")}
    assert estimate_hf(bare, weights_bytes=MIB).weights_mb == 1
    with pytest.raises(ValueError, match="vocab_size"):
        estimate_hf(bare)


def test_context_override_and_cap() -> None:
    long = qwen(max_position_embeddings=131072)
    capped = estimate_hf(long)
    assert capped.context_tokens == DEFAULT_CONTEXT_CAP == 32768
    assert "(ctx 32768: model max 131072, capped)" in capped.detail
    full = estimate_hf(long, context_tokens=131072)  # an explicit context is not capped
    assert full.context_tokens == 131072
    assert full.kv_cache_mb == 4 * capped.kv_cache_mb
    short = estimate_hf(QWEN7B, context_tokens=4096)
    assert short.kv_cache_mb == 2 * 28 * 4 * 128 * 2 * 4096 // MIB == 224
    assert "4096 tokens" in short.detail and "capped" not in short.detail
    small = estimate_hf(qwen(max_position_embeddings=2048))
    assert small.context_tokens == 2048  # below the cap: the model's own maximum
    with pytest.raises(ValueError, match="context_tokens"):
        estimate_hf(QWEN7B, context_tokens=0)


@pytest.mark.parametrize(
    "key", ["hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
            "intermediate_size", "max_position_embeddings"],
)  # fmt: skip
def test_missing_key_is_named(key: str) -> None:
    cfg = {k: v for k, v in QWEN7B.items() if k != key}
    with pytest.raises(ValueError, match=key):
        estimate_hf(cfg)


def test_missing_context_is_fine_with_explicit_context() -> None:
    cfg = {k: v for k, v in QWEN7B.items() if k != "max_position_embeddings"}
    assert estimate_hf(cfg, context_tokens=8192).context_tokens == 8192


def test_bad_values_raise() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        estimate_hf(qwen(hidden_size="big"))
    with pytest.raises(ValueError, match="num_attention_heads"):
        estimate_hf(qwen(num_attention_heads=0))
    with pytest.raises(ValueError, match="weights_bytes"):
        estimate_hf(QWEN7B, weights_bytes=-1)


def test_overhead_rule() -> None:
    assert overhead_mb(0) == 512
    assert overhead_mb(20 * 1024 * MIB) == 512 + 1024


# ---------------------------------------------------------------- GGUF metadata (pure)

LLAMA_META: dict[str, Any] = {
    "general.architecture": "llama",
    "llama.block_count": 32,
    "llama.embedding_length": 4096,
    "llama.attention.head_count": 32,
    "llama.attention.head_count_kv": 8,
    "llama.context_length": 8192,
}


def test_gguf_meta_kv_from_embedding_over_heads() -> None:
    est = estimate_gguf_meta(LLAMA_META, file_bytes=4_920_000_000)
    assert est.source == "gguf"
    assert est.weights_mb == math.ceil(4_920_000_000 / MIB)
    assert est.context_tokens == 8192
    assert est.kv_cache_mb == 2 * 32 * 8 * 128 * 2 * 8192 // MIB == 1024
    assert est.overhead_mb == overhead_mb(4_920_000_000)
    assert "KV 32 layers x 2 x 8 kv-heads x 128 dim x 2 B x 8192 tokens" in est.detail
    check_sums(est)


def test_gguf_meta_key_value_lengths_per_layer_and_defaults() -> None:
    meta = {**LLAMA_META, "llama.attention.key_length": 192, "llama.attention.value_length": 128}
    est = estimate_gguf_meta(meta, file_bytes=0, context_tokens=1024)
    assert est.kv_cache_mb == 32 * 8 * (192 + 128) * 2 * 1024 // MIB
    assert "(192 k + 128 v) dim" in est.detail
    hybrid = {**LLAMA_META, "llama.attention.head_count_kv": [8, 0] * 16}  # 0: recurrent
    assert estimate_gguf_meta(hybrid, file_bytes=0).kv_cache_mb == 1024 // 2
    mha = {k: v for k, v in LLAMA_META.items() if k != "llama.attention.head_count_kv"}
    assert estimate_gguf_meta(mha, file_bytes=0).kv_cache_mb == 4 * 1024
    long = {**LLAMA_META, "llama.context_length": 131072}
    assert estimate_gguf_meta(long, file_bytes=0).context_tokens == DEFAULT_CONTEXT_CAP


@pytest.mark.parametrize(
    "key", ["general.architecture", "llama.block_count", "llama.attention.head_count",
            "llama.embedding_length", "llama.context_length"],
)  # fmt: skip
def test_gguf_meta_missing_key_is_named(key: str) -> None:
    meta = {k: v for k, v in LLAMA_META.items() if k != key}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        estimate_gguf_meta(meta, file_bytes=1)


def test_gguf_meta_bad_per_layer_array() -> None:
    with pytest.raises(ValueError, match="head_count_kv"):
        estimate_gguf_meta({**LLAMA_META, "llama.attention.head_count_kv": [8, 8]}, file_bytes=1)
