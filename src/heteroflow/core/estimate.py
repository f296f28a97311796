"""GPU memory estimate of a model from its metadata (FEATURES B8): pure math, no I/O.

Creating a task group prechecks the estimate against the cards' memory as an upper
bound; a model that cannot be estimated skips the precheck. All ``*_mb`` values are MiB
(2**20 bytes), the unit NVML and the placement filter use. ``total = weights + kv + overhead``:

* **Weights.** The real size of the weight files when known (``weights_bytes``, or the GGUF
  file size). Otherwise, for a Hugging Face ``config.json``, the parameter count of a
  decoder-only transformer (the layout of ``transformers``' Llama/Qwen2/Mistral/Mixtral/
  Qwen-MoE/DeepSeek-V3 modelling code; biases are ignored)::

      embeddings  vocab x hidden, twice unless tie_word_embeddings (lm_head)
      attention   hidden x heads*head_dim (q) + 2 x hidden x kv_heads*head_dim (k, v)
                  + heads*head_dim x hidden (o);  MLA (kv_lora_rank set, DeepSeek-V2/V3):
                  q (via q_lora_rank) + kv_a + kv_b + o, from the low-rank dimensions
      MLP         3 x hidden x intermediate (gated: gate, up, down; a 2-matrix MLP is
                  over-counted, erring high as an upper bound should)
      MoE layer   experts x 3 x hidden x moe_intermediate_size (all experts are resident)
                  + shared experts + a hidden x experts router
      norms       2 x hidden per layer + hidden

  times the bytes of ``torch_dtype``/``dtype`` (float32 4, float16/bfloat16 2, float8 1;
  16-bit assumed when absent), or ``quantization_config`` bits for the layers while the
  embeddings and lm_head keep ``torch_dtype`` (GPTQ/AWQ/fp8 checkpoints keep them so).
  Only the language model is counted; a vision tower is in ``weights_bytes`` when the
  files are known. Multimodal configs nest the text model under ``text_config``.
* **KV cache** per token = 2 (K and V) x layers x kv_heads x head_dim x kv dtype bytes
  (MLA caches one latent: layers x (kv_lora_rank + qk_rope_head_dim) x bytes). The kv
  dtype defaults to 2 bytes: vLLM's ``kv_cache_dtype=auto`` and llama.cpp's default cache
  are 16-bit, even for float32 or quantized weights. Sliding windows are not modelled.
* **Context.** The context the engine will really run with: ``context_tokens`` when
  given; else ``engine_context``, what the engine's own flag in the task's arguments says
  (llama.cpp ``-c``, vLLM ``--max-model-len``, ...: :func:`heteroflow.core.engines.
  registry.engine_context`), where "the model's own length" (llama.cpp ``-c 0``) is the
  trained maximum uncapped; else the model's trained maximum (``max_position_embeddings``
  / ``{arch}.context_length``) capped at :data:`DEFAULT_CONTEXT_CAP` (32768): long-context
  models (128k-1M) are usually served with a shorter window, and sizing the precheck for
  1M tokens would reject them outright. The detail says which and why: ``(ctx 4096 from
  -c)``, ``(ctx 32768: model max 131072, capped)``.
* **Overhead** = :data:`OVERHEAD_FIXED_MB` (512) + :data:`OVERHEAD_WEIGHTS_RATIO` (5%) of
  the weights. The fixed part covers the CUDA context and cuBLAS/attention workspaces a
  serving process allocates regardless of model (about 300-500 MiB on current GPUs); the
  proportional part covers activation/compute buffers (vLLM's profiled forward peak,
  llama.cpp's compute buffer), which grow with the hidden and vocab sizes, hence roughly
  with the weights, plus allocator fragmentation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from heteroflow.core.engines.context import EngineContext

MIB = 1 << 20
DEFAULT_CONTEXT_CAP = 32_768
DEFAULT_KV_DTYPE_BYTES = 2
OVERHEAD_FIXED_MB = 512
OVERHEAD_WEIGHTS_RATIO = 0.05

_DTYPE_BYTES = {
    "float32": 4.0, "float": 4.0, "fp32": 4.0,
    "float16": 2.0, "half": 2.0, "fp16": 2.0, "bfloat16": 2.0, "bf16": 2.0,
    "float8_e4m3fn": 1.0, "float8_e5m2": 1.0, "float8_e4m3fnuz": 1.0, "fp8": 1.0,
}  # fmt: skip
_FP8_METHODS = {"fp8", "fbgemm_fp8", "fp8_e4m3"}
_NESTED_TEXT = ("text_config", "llm_config")


@dataclass(frozen=True)
class MemoryEstimate:
    weights_mb: int
    kv_cache_mb: int
    overhead_mb: int  # 512 MiB + 5% of the weights: CUDA context, workspaces, activations
    total_mb: int
    context_tokens: int
    source: str  # "hf-config" | "gguf"
    detail: str  # one line with the numbers, shown to users


def overhead_mb(weights_bytes: int) -> int:
    """The overhead rule: 512 MiB fixed + 5% of the weights (see the module docstring)."""
    return OVERHEAD_FIXED_MB + math.ceil(weights_bytes * OVERHEAD_WEIGHTS_RATIO / MIB)


def _size(n_bytes: float) -> str:
    return f"{n_bytes / (1 << 30):.1f} GiB" if n_bytes >= 1 << 30 else f"{n_bytes / MIB:.1f} MiB"


def _count(n: float) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return str(int(n))


def _num(b: float) -> str:
    return f"{b:g}"


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is None:
            raise ValueError(f"model metadata lacks {key!r}")
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ValueError(f"model metadata has a non-numeric or negative {key!r}: {value!r}")
    return int(value)


def _context(
    trained: int | None, requested: int | None, engine: EngineContext | None, key: str
) -> tuple[int, str]:
    """The KV tokens and why, as `` (ctx N ...)`` for the detail."""
    if requested is not None:
        if requested <= 0:
            raise ValueError(f"context_tokens must be positive, got {requested}")
        return requested, f" (ctx {requested} as asked)"
    if engine is not None and engine.tokens is not None:
        if engine.tokens <= 0:
            raise ValueError(f"the engine's context must be positive, got {engine.tokens}")
        return engine.tokens, f" (ctx {engine.tokens} from {engine.source})"
    if not trained:
        raise ValueError(f"model metadata lacks {key!r} (and no context was given)")
    if engine is not None:  # the engine was told to take the model's own length
        return trained, f" (ctx {trained} from {engine.source}: the model's trained length)"
    if trained > DEFAULT_CONTEXT_CAP:
        return DEFAULT_CONTEXT_CAP, f" (ctx {DEFAULT_CONTEXT_CAP}: model max {trained}, capped)"
    return trained, f" (ctx {trained}: the model's trained length)"


def _finish(weights: float, kv: float, ctx: int, source: str, w_text: str, kv_text: str
            ) -> MemoryEstimate:
    w_mb, kv_mb, oh_mb = math.ceil(weights / MIB), math.ceil(kv / MIB), overhead_mb(int(weights))
    total = w_mb + kv_mb + oh_mb
    detail = (f"{w_text} + {kv_text} + overhead {_size(oh_mb * MIB)} "
              f"(512 MiB + 5% of weights) = {_size(total * MIB)}")
    return MemoryEstimate(w_mb, kv_mb, oh_mb, total, ctx, source, detail)


# ---------------------------------------------------------------- Hugging Face config.json


def _text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    cfg = dict(config)
    for key in _NESTED_TEXT:
        nested = config.get(key)
        if isinstance(nested, Mapping):
            cfg.update(nested)  # the text model's keys win over the wrapper's
    return cfg


def _dtype(cfg: Mapping[str, Any]) -> tuple[float, str]:
    for key in ("torch_dtype", "dtype"):
        name = str(cfg.get(key) or "").removeprefix("torch.").lower()
        if name in _DTYPE_BYTES:
            return _DTYPE_BYTES[name], name
    return 2.0, "16-bit assumed"


def _quant_bits(cfg: Mapping[str, Any]) -> tuple[float, str] | None:
    """Weight bits of the quantized layers, from ``quantization_config``; None if absent."""
    q = cfg.get("quantization_config")
    if not isinstance(q, Mapping):
        return None
    method = str(q.get("quant_method") or "quantized").lower()
    bits: Any = q.get("bits", q.get("w_bit"))
    if bits is None:
        if q.get("load_in_4bit"):
            bits = 4
        elif q.get("load_in_8bit") or method in _FP8_METHODS:
            bits = 8
        elif method == "mxfp4":
            bits = 4.25  # 4-bit values + one 8-bit scale per 32
        elif isinstance(groups := q.get("config_groups"), Mapping):  # compressed-tensors
            weights = [g.get("weights") for g in groups.values() if isinstance(g, Mapping)]
            bits = next((w.get("num_bits") for w in weights if isinstance(w, Mapping)), None)
    if isinstance(bits, bool) or not isinstance(bits, int | float) or bits <= 0:
        return None
    return float(bits), method


def _moe_layers(cfg: Mapping[str, Any], layers: int) -> int:
    first_dense = _int(cfg, "first_k_dense_replace", 0)
    step = max(_int(cfg, "decoder_sparse_step", 1), 1)
    dense_only = set(cfg.get("mlp_only_layers") or ())
    return sum(1 for i in range(first_dense, layers) if (i + 1) % step == 0 and i not in dense_only)


def _layer_params(cfg: Mapping[str, Any], hidden: int, heads: int, head_dim: int) -> int:
    """Attention + norm parameters of one decoder layer."""
    if cfg.get("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3)
        kv_rank, rope = _int(cfg, "kv_lora_rank"), _int(cfg, "qk_rope_head_dim")
        nope, v_dim = _int(cfg, "qk_nope_head_dim"), _int(cfg, "v_head_dim")
        q_rank = _int(cfg, "q_lora_rank", 0)
        q_out = heads * (nope + rope)
        q = hidden * q_rank + q_rank * q_out if q_rank else hidden * q_out
        kv = hidden * (kv_rank + rope) + kv_rank * heads * (nope + v_dim)
        return q + kv + heads * v_dim * hidden + 2 * hidden
    kv_heads = _int(cfg, "num_key_value_heads", heads)
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    return 2 * hidden * q_dim + 2 * hidden * kv_dim + 2 * hidden


def _mlp_params(cfg: Mapping[str, Any], hidden: int, layers: int) -> int:
    intermediate = _int(cfg, "intermediate_size")
    experts = next((_int(cfg, k) for k in ("num_experts", "num_local_experts",
                                            "n_routed_experts") if cfg.get(k)), 0)
    if experts <= 1:
        return layers * 3 * hidden * intermediate
    moe = _moe_layers(cfg, layers)
    expert = _int(cfg, "moe_intermediate_size", intermediate)
    shared = _int(cfg, "n_shared_experts", 0) * expert + _int(
        cfg, "shared_expert_intermediate_size", 0)
    per_moe = experts * 3 * hidden * expert + 3 * hidden * shared + hidden * experts
    return (layers - moe) * 3 * hidden * intermediate + moe * per_moe


def _hf_weights(cfg: Mapping[str, Any], hidden: int, layers: int, heads: int,
                head_dim: int) -> tuple[float, str]:
    vocab = _int(cfg, "vocab_size")
    embed = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    body = layers * _layer_params(cfg, hidden, heads, head_dim) + hidden
    body += _mlp_params(cfg, hidden, layers)
    dtype_bytes, dtype_name = _dtype(cfg)
    quant = _quant_bits(cfg)
    if quant is None:
        n_bytes = (embed + body) * dtype_bytes
        text = f"{_count(embed + body)} params x {_num(dtype_bytes)} B ({dtype_name})"
    else:
        bits, method = quant
        n_bytes = body * bits / 8 + embed * dtype_bytes
        text = (f"{_count(body)} params x {_num(bits)} bit ({method}) + {_count(embed)} "
                f"embedding params x {_num(dtype_bytes)} B ({dtype_name})")
    return n_bytes, f"{text} = {_size(n_bytes)} weights"


def _kv_text(layers: int | None, kv_heads: str, k_dim: int, v_dim: int, kv_bytes: float,
             ctx: int) -> str:
    """``KV 28 layers x 2 x 4 kv-heads x 128 dim x 2 B x 32768 tokens`` and variants."""
    lead = f"{layers} layers x " if layers is not None else ""
    dims = (f"2 x {kv_heads} kv-heads x {k_dim} dim" if k_dim == v_dim
            else f"{kv_heads} kv-heads x ({k_dim} k + {v_dim} v) dim")
    return f"KV {lead}{dims} x {_num(kv_bytes)} B x {ctx} tokens"


def estimate_hf(
    config: Mapping[str, Any],
    *,
    context_tokens: int | None = None,
    weights_bytes: int | None = None,
    kv_dtype_bytes: int | None = None,
    engine_context: EngineContext | None = None,
) -> MemoryEstimate:
    """Estimate from a Hugging Face ``config.json`` (see the module docstring for formulas).

    ``weights_bytes`` (the size of the weight files), when given, replaces the parameter
    count. Raises ``ValueError`` naming the key when the config lacks what is needed.
    """
    cfg = _text_config(config)
    hidden, layers = _int(cfg, "hidden_size"), _int(cfg, "num_hidden_layers")
    heads = _int(cfg, "num_attention_heads")
    if heads == 0:
        raise ValueError("model metadata has num_attention_heads = 0")
    head_dim = _int(cfg, "head_dim", hidden // heads)
    kv_bytes = kv_dtype_bytes or DEFAULT_KV_DTYPE_BYTES
    trained = _int(cfg, "max_position_embeddings", 0)
    ctx, why = _context(trained, context_tokens, engine_context, "max_position_embeddings")
    if cfg.get("kv_lora_rank"):
        latent, rope = _int(cfg, "kv_lora_rank"), _int(cfg, "qk_rope_head_dim")
        kv = layers * (latent + rope) * kv_bytes * ctx
        kv_text = (f"KV {layers} layers x ({latent} latent + {rope} rope) dim x "
                   f"{_num(kv_bytes)} B x {ctx} tokens")
    else:
        kv_heads = _int(cfg, "num_key_value_heads", heads)
        kv = 2 * layers * kv_heads * head_dim * kv_bytes * ctx
        kv_text = _kv_text(layers, str(kv_heads), head_dim, head_dim, kv_bytes, ctx)
    if weights_bytes is not None:
        if weights_bytes < 0:
            raise ValueError(f"weights_bytes must not be negative, got {weights_bytes}")
        weights, w_text = float(weights_bytes), f"weights {_size(weights_bytes)} (weight files)"
    else:
        weights, w_text = _hf_weights(cfg, hidden, layers, heads, head_dim)
    return _finish(weights, kv, ctx, "hf-config", w_text, f"{kv_text} = {_size(kv)}{why}")


# ---------------------------------------------------------------- GGUF metadata


def _per_layer(meta: Mapping[str, Any], key: str, layers: int, default: Any) -> list[int]:
    """A ``{arch}.*`` value that is a scalar or (hybrid/OpenELM-style) a per-layer array."""
    value = meta.get(key, default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    values = list(value) if isinstance(value, list | tuple) else [value] * layers
    if len(values) != layers or not all(isinstance(v, int | float) and v >= 0 for v in values):
        raise ValueError(f"GGUF metadata has an unusable {key!r}: {value!r}")
    return [int(v) for v in values]


def estimate_gguf_meta(
    meta: Mapping[str, Any],
    *,
    file_bytes: int,
    context_tokens: int | None = None,
    kv_dtype_bytes: int | None = None,
    engine_context: EngineContext | None = None,
) -> MemoryEstimate:
    """Estimate from GGUF key/values (:func:`heteroflow.models.estimate.read_gguf_meta`).

    Weights = ``file_bytes`` (all shards). KV per token = sum over layers of
    ``head_count_kv x (key_length + value_length) x kv bytes`` (f16, 2 bytes, by default, as
    llama.cpp's ``--cache-type-k/v f16``); ``key_length``/``value_length`` default to
    ``embedding_length / head_count``. A layer with 0 kv-heads (a recurrent layer) caches
    nothing. Context = ``context_tokens``, else ``engine_context``, else
    ``{arch}.context_length`` capped at 32768 (see the module docstring).
    """
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise ValueError("GGUF metadata lacks 'general.architecture'")
    if file_bytes < 0:
        raise ValueError(f"file_bytes must not be negative, got {file_bytes}")
    layers = _int(meta, f"{arch}.block_count")
    heads = _per_layer(meta, f"{arch}.attention.head_count", layers, None)
    kv_heads = _per_layer(meta, f"{arch}.attention.head_count_kv", layers, heads)
    key_length = f"{arch}.attention.key_length"
    if meta.get(key_length) is not None:
        k_dim = _int(meta, key_length)
    else:
        k_dim = _int(meta, f"{arch}.embedding_length") // max(max(heads, default=1), 1)
    v_dim = _int(meta, f"{arch}.attention.value_length", k_dim)
    kv_bytes = kv_dtype_bytes or DEFAULT_KV_DTYPE_BYTES
    trained = _int(meta, f"{arch}.context_length", 0)
    ctx, why = _context(trained, context_tokens, engine_context, f"{arch}.context_length")
    kv = sum(kv_heads) * (k_dim + v_dim) * kv_bytes * ctx
    if len(set(kv_heads)) <= 1:
        kv_text = _kv_text(layers, str(kv_heads[0] if kv_heads else 0), k_dim, v_dim, kv_bytes,
                           ctx)
    else:  # per-layer kv-heads: show their sum
        kv_text = _kv_text(None, f"{sum(kv_heads)} (summed over {layers} layers)", k_dim, v_dim,
                           kv_bytes, ctx)
    w_text = f"weights {_size(file_bytes)} (GGUF {arch})"
    return _finish(float(file_bytes), kv, ctx, "gguf", w_text, f"{kv_text} = {_size(kv)}{why}")
