"""The memory estimate sizes the KV cache for the context the engine really runs with.

Each engine's context flag is read as that engine's own parser reads it (spellings, the
``=`` form, ``_`` for ``-``, value forms, last occurrence wins), and the estimate's detail
says which context it used and why.
"""

from __future__ import annotations

import pytest

from heteroflow.core.engines import ENGINES, EngineContext, engine_context
from heteroflow.core.engines.flags import accepted_flags
from heteroflow.core.engines.mindie import MAX_SEQ_LEN
from heteroflow.core.estimate import DEFAULT_CONTEXT_CAP, MIB, estimate_gguf_meta, estimate_hf

pytestmark = pytest.mark.feature("B8")

# A Qwen2-7B-like config: 28 layers x 4 kv-heads x 128 dim -> 28 x 2 x 4 x 128 x 2 B per token
QWEN = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
KV_PER_TOKEN = 28 * 2 * 4 * 128 * 2


def _ctx(engine: str, *args: str) -> EngineContext | None:
    return engine_context(engine, list(args))


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["-np", "2", "-c", "4096", "--embeddings"], EngineContext(4096, "-c")),
        (["--ctx-size", "8192"], EngineContext(8192, "--ctx-size")),
        (["--ctx_size", "8192"], EngineContext(8192, "--ctx-size")),  # '_' reads as '-'
        (["-c", "8192", "--ctx-size", "2048"], EngineContext(2048, "--ctx-size")),  # last wins
        (["-c", "0"], EngineContext(None, "-c 0")),  # 0 = the model's own length
        (["--ctx-size=4096"], None),  # llama.cpp has no --flag=value form
        (["-c", "many"], None),  # refused by the engine: nothing to read
        (["-c", "-5"], None),
        (["-c"], None),  # no value
        # none set: the platform passes its own -c (issue 33: the estimate said 32,768 while
        # the process runtime ran 4,096)
        (["-ngl", "0"], EngineContext(4096, "HeteroFlow's default -c")),
        ([], EngineContext(4096, "HeteroFlow's default -c")),
    ],
)
def test_llamacpp_ctx_size(args: list[str], expected: EngineContext | None) -> None:
    assert _ctx("llamacpp", *args) == expected


@pytest.mark.parametrize("engine", ["vllm", "vllm-mtt"])
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max-model-len", "4096"], EngineContext(4096, "--max-model-len")),
        (["--max-model-len=16384"], EngineContext(16384, "--max-model-len")),
        (["--max_model_len", "4096"], EngineContext(4096, "--max-model-len")),
        (["--max-model-len", "32k"], EngineContext(32000, "--max-model-len 32k")),
        (["--max-model-len", "25.6k"], EngineContext(25600, "--max-model-len 25.6k")),
        (["--max-model-len", "32K"], EngineContext(32768, "--max-model-len 32K")),
        (["--max-model-len", "1Ki"], EngineContext(1024, "--max-model-len 1Ki")),
        (["--max-model-len", "auto"], EngineContext(None, "--max-model-len auto")),
        (["--max-model-len", "-1"], EngineContext(None, "--max-model-len -1")),
        (["--max-model-len", "2.5K"], None),  # no decimals with binary suffixes
        (["--max-model-len", "0"], None),
        (["--max-num-seqs", "8"], None),
    ],
)
def test_vllm_max_model_len(engine: str, args: list[str], expected: EngineContext | None) -> None:
    assert _ctx(engine, *args) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--context-length", "8192"], EngineContext(8192, "--context-length")),
        (["--context-length=4096"], EngineContext(4096, "--context-length")),
        (["--context_length", "4096"], None),  # SGLang's argparse has no '_' spelling
        (["--context-length", "8k"], None),  # plain integers only
    ],
)
def test_sglang_context_length(args: list[str], expected: EngineContext | None) -> None:
    assert _ctx("sglang", *args) == expected


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--max_seq_len", "4096"], EngineContext(4096, "--max_seq_len")),
        (["--max_seq_len=2048"], EngineContext(2048, "--max_seq_len")),
        (["--max-seq-len", "4096"], None),  # click registered the underscore spelling
    ],
)
def test_trtllm_max_seq_len(args: list[str], expected: EngineContext | None) -> None:
    assert _ctx("trtllm", *args) == expected


def test_mindie_runs_with_its_generated_config_whatever_the_args() -> None:
    fixed = EngineContext(MAX_SEQ_LEN, "mindie's generated config")
    assert _ctx("mindie") == fixed
    assert _ctx("mindie", "--max-model-len", "4096") == fixed


def test_a_custom_command_without_a_known_engine_says_nothing() -> None:
    assert _ctx("", "-c", "4096") is None
    assert _ctx("no-such-engine", "-c", "4096") is None


def test_every_context_flag_is_a_flag_the_engine_accepts() -> None:
    """The spellings are the engines' own (flags.py, transcribed from their CLIs)."""
    for name, spec in ENGINES.items():
        if spec.context_flag is None:
            assert spec.fixed_context is not None, name  # every engine says its context
            continue
        for spelling in spec.context_flag.spellings:
            assert spelling in accepted_flags(name), (name, spelling)


def test_the_detail_says_which_context_and_why() -> None:
    from_flag = estimate_hf(QWEN, engine_context=_ctx("vllm", "--max-model-len", "4096"))
    assert from_flag.context_tokens == 4096
    assert from_flag.kv_cache_mb == KV_PER_TOKEN * 4096 // MIB
    assert "x 4096 tokens = 224.0 MiB (ctx 4096 from --max-model-len)" in from_flag.detail

    capped = estimate_hf(QWEN, engine_context=_ctx("vllm"))  # no flag: the model's, capped
    assert capped.context_tokens == DEFAULT_CONTEXT_CAP
    assert "(ctx 32768: model max 131072, capped)" in capped.detail

    full = estimate_hf(QWEN, engine_context=_ctx("vllm", "--max-model-len", "auto"))
    assert full.context_tokens == 131072  # asked for the model's whole length: not capped
    assert "(ctx 131072 from --max-model-len auto: the model's trained length)" in full.detail

    short = estimate_hf({**QWEN, "max_position_embeddings": 8192})
    assert "(ctx 8192: the model's trained length)" in short.detail

    asked = estimate_hf(QWEN, context_tokens=1024, engine_context=_ctx("vllm"))
    assert asked.context_tokens == 1024 and "(ctx 1024 as asked)" in asked.detail


def test_gguf_estimate_with_llamacpp_c() -> None:
    meta = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 18,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.embedding_length": 640,
        "gemma3.context_length": 32768,
    }
    demo = estimate_gguf_meta(
        meta, file_bytes=241 * MIB, engine_context=_ctx("llamacpp", "-np", "2", "-c", "4096")
    )
    bare = estimate_gguf_meta(
        meta, file_bytes=241 * MIB, engine_context=_ctx("llamacpp", "-c", "0")
    )
    assert (demo.context_tokens, bare.context_tokens) == (4096, 32768)
    assert demo.kv_cache_mb == 18 * 2 * 256 * 2 * 4096 // MIB == 72
    assert bare.kv_cache_mb == 8 * demo.kv_cache_mb
    assert demo.total_mb < bare.total_mb
    assert "(ctx 4096 from -c)" in demo.detail
    assert "(ctx 32768 from -c 0: the model's trained length)" in bare.detail
