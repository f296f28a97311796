"""Deterministic tiny llama GGUF used as the test and demo model for llama.cpp engines.

This module owns the *content* of ``heteroflow-tiny``: a 2-layer, 64-dim llama with random
weights drawn from a fixed seed, a byte-level SentencePiece vocabulary (``<unk>``, ``<s>``,
``</s>``, the 256 ``<0xXX>`` byte tokens, ``<|im_start|>``, ``<|im_end|>``), a ChatML chat
template and mean pooling, so one llama.cpp server can answer chat, completion and embedding
requests. The file is about 470 KB and is written in well under a second.

Generated text is always printable ASCII: every other token (control tokens, and bytes outside
0x20..0x7E, which could form invalid UTF-8) gets a large negative logit. Consequently the
model never emits an end-of-generation token and always generates until ``max_tokens`` or
the context is full; callers should always set ``max_tokens``.

Run ``python -m heteroflow.models.tiny_gguf OUT.gguf`` to write the file from a shell.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

__all__ = ["TINY_MODEL_NAME", "main", "write_sized_gguf", "write_tiny_gguf"]

TINY_MODEL_NAME = "heteroflow-tiny"

_SEED = 20_240_601
_N_LAYER = 2
_N_EMBD = 64
_N_HEAD = 4
_N_HEAD_KV = 4
_N_FF = 128
_N_CTX_TRAIN = 2048
# Dimension 0 of the residual stream is a constant "bias" channel (see _build_tensors).
_BIAS_DIM = 0
_BIAS_VALUE = 4.0
_FORBIDDEN_LOGIT_WEIGHT = -16.0

_SPECIALS_HEAD = ("<unk>", "<s>", "</s>")
_SPECIALS_TAIL = ("<|im_start|>", "<|im_end|>")
_BYTE_OFFSET = len(_SPECIALS_HEAD)

_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# The tool-calling variant (``write_tiny_gguf(..., tools=True)``): ChatML plus the Hermes
# tool format (tools listed in a system turn, calls as <tool_call>{json}</tool_call>), which
# llama.cpp's Jinja chat code recognises; it then constrains a tool call by grammar.
_HERMES_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{%- endif %}"
    "# Tools\n\nYou may call functions. Signatures within <tools></tools>:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each call return a json object with name and arguments within <tool_call></tool_call>:"
    "\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant' }}{%- if message.content %}{{ '\n' + message.content }}{%- endif %}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function is defined %}{%- set call = call.function %}{%- endif %}"
    "{{ '\n<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{{ call.arguments | tojson }}{{ '}\n</tool_call>' }}"
    "{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{ '<|im_start|>user\n<tool_response>\n' + message.content }}"
    "{{ '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}"
    "{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)

_F32 = npt.NDArray[np.float32]


def _vocab() -> tuple[list[str], list[int]]:
    tokens = list(_SPECIALS_HEAD) + [f"<0x{b:02X}>" for b in range(256)] + list(_SPECIALS_TAIL)
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.CONTROL] * len(_SPECIALS_TAIL)
    )
    return tokens, [int(t) for t in types]


def _allowed_output_ids(n_vocab: int) -> npt.NDArray[np.bool_]:
    allowed = np.zeros(n_vocab, dtype=np.bool_)
    allowed[_BYTE_OFFSET + 0x20 : _BYTE_OFFSET + 0x7F] = True
    return allowed


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> _F32:
    return (rng.standard_normal(shape) * std).astype(np.float32)


def _build_tensors(n_vocab: int, n_ff: int = _N_FF) -> dict[str, _F32]:
    """Random weights with a constant bias channel that suppresses non-printable tokens.

    Token embeddings carry ``_BIAS_VALUE`` in ``_BIAS_DIM``; the layer norms ignore that
    dimension and the layers never write to it, so it survives to the output norm as a large
    positive value. Output rows of forbidden tokens are zero except for a strongly negative
    weight on that channel, which pushes their logits far below any printable byte's, so
    even high-temperature sampling cannot produce invalid UTF-8 or control tokens.
    """
    rng = np.random.default_rng(_SEED)
    ones = np.ones(_N_EMBD, dtype=np.float32)
    layer_norm = ones.copy()
    layer_norm[_BIAS_DIM] = 0.0

    embd = _normal(rng, (n_vocab, _N_EMBD), 1.0)
    embd[:, _BIAS_DIM] = _BIAS_VALUE
    tensors: dict[str, _F32] = {"token_embd.weight": embd}

    head_dim = _N_EMBD // _N_HEAD
    attn_std = 1.0 / np.sqrt(_N_EMBD)
    for i in range(_N_LAYER):
        attn_out = _normal(rng, (_N_EMBD, _N_EMBD), attn_std)
        attn_out[_BIAS_DIM, :] = 0.0
        ffn_down = _normal(rng, (_N_EMBD, n_ff), 1.0 / np.sqrt(n_ff))
        ffn_down[_BIAS_DIM, :] = 0.0
        tensors |= {
            f"blk.{i}.attn_norm.weight": layer_norm.copy(),
            f"blk.{i}.attn_q.weight": _normal(rng, (_N_EMBD, _N_EMBD), attn_std),
            f"blk.{i}.attn_k.weight": _normal(rng, (_N_HEAD_KV * head_dim, _N_EMBD), attn_std),
            f"blk.{i}.attn_v.weight": _normal(rng, (_N_HEAD_KV * head_dim, _N_EMBD), attn_std),
            f"blk.{i}.attn_output.weight": attn_out,
            f"blk.{i}.ffn_norm.weight": layer_norm.copy(),
            f"blk.{i}.ffn_gate.weight": _normal(rng, (n_ff, _N_EMBD), attn_std),
            f"blk.{i}.ffn_up.weight": _normal(rng, (n_ff, _N_EMBD), attn_std),
            f"blk.{i}.ffn_down.weight": ffn_down,
        }

    output = _normal(rng, (n_vocab, _N_EMBD), 0.3)
    allowed = _allowed_output_ids(n_vocab)
    output[~allowed, :] = 0.0
    output[:, _BIAS_DIM] = np.where(allowed, 0.0, _FORBIDDEN_LOGIT_WEIGHT)
    tensors["output_norm.weight"] = ones
    tensors["output.weight"] = output
    return tensors


def _write(path: Path, *, tools: bool = False, n_ff: int = _N_FF) -> None:
    tokens, token_types = _vocab()
    n_vocab = len(tokens)
    arch = "llama"
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(TINY_MODEL_NAME)
    writer.add_file_type(int(gguf.LlamaFileType.ALL_F32))
    writer.add_vocab_size(n_vocab)
    writer.add_context_length(_N_CTX_TRAIN)
    writer.add_embedding_length(_N_EMBD)
    writer.add_block_count(_N_LAYER)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(_N_HEAD)
    writer.add_head_count_kv(_N_HEAD_KV)
    writer.add_rope_dimension_count(_N_EMBD // _N_HEAD)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * n_vocab)
    writer.add_token_types(token_types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    if tools:
        # SentencePiece would put a space after <|im_start|> ("▁assistant"), which the tool
        # grammar (it starts with the generation prompt) rejects: llama.cpp then fails the
        # request with "Failed to initialize samplers" (measured).
        writer.add_add_space_prefix(False)
    writer.add_chat_template(_HERMES_TOOLS_TEMPLATE if tools else _CHATML_TEMPLATE)
    for name, tensor in _build_tensors(n_vocab, n_ff).items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_tiny_gguf(path: Path, *, tools: bool = False) -> Path:
    """Write the tiny model to ``path`` and return it; an identical existing file is kept.

    ``tools``: the tool-calling variant, whose chat template renders ``tools`` (Hermes
    format) so llama.cpp answers them with grammar-constrained ``tool_calls``; the default
    model's plain ChatML template makes llama.cpp ignore ``tools``.

    The bytes are rendered to a sibling temp file first and moved into place atomically, so
    concurrent writers and readers never see a half-written model, and an unchanged file
    keeps its mtime (servers that already mapped it are not disturbed).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    tmp.chmod(0o644)  # mkstemp creates 0600; model files are meant to be shared read-only
    try:
        _write(tmp, tools=tools)
        if path.is_file() and _sha256(path) == _sha256(tmp):
            return path
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_sized_gguf(path: Path, megabytes: int) -> Path:
    """The tiny model widened until its file holds about ``megabytes`` MB: the same
    vocabulary, template and printable-only output, its feed-forward layers as wide as it
    takes (what a cold start of a big model reads, e.g. bench/cold_start.py). Generation
    stays cheap (64 dims); writing 2 GB takes a few seconds. An existing file of the same
    name and size is kept."""
    path = Path(path)
    per_ff_row = _N_LAYER * 3 * _N_EMBD * 4  # gate, up, down: f32, per unit of n_ff
    n_ff = max(_N_FF, megabytes * 1_000_000 // per_ff_row)
    if path.is_file() and abs(path.stat().st_size - n_ff * per_ff_row) < 2_000_000:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write(tmp, n_ff=n_ff)
        tmp.chmod(0o644)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``python -m heteroflow.models.tiny_gguf OUT.gguf``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m heteroflow.models.tiny_gguf OUT.gguf", file=sys.stderr)
        return 2
    print(write_tiny_gguf(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
