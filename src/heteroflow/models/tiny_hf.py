"""A tiny Hugging Face model directory whose answers are known in advance (vLLM tests).

``write_tiny_hf(DIR)`` writes a Hermes-style Llama — ``config.json``,
``generation_config.json``, ``tokenizer.json`` + ``tokenizer_config.json`` (a ChatML chat
template that lists ``tools`` Hermes-style) and ``model.safetensors`` — in well under a
second, with no hub and no torch: numpy, the ``tokenizers`` library and the safetensors
layout written by hand (an 8-byte header length, a JSON header, the raw tensors).

A Llama with ChatML, ``<tool_call>`` tokens and a directory named ``…hermes…``, as
NousResearch's Hermes 2 Pro is, so that the platform's own tool-parser registry
(``core/engines/tool_parsers.py``) gives vLLM ``hermes`` for it. Not Qwen2: transformers 5
replaces the tokenizer of a ``qwen2`` config by its own BPE class whatever
``tokenizer_config.json`` says, and this word-level tokenizer would then encode nothing.

The weights are wired by hand, not trained, so that greedy *and* sampled output is fixed
(the chosen logit leads the next by ~40):

* The residual stream holds the current token one-hot (dims ``0..V-1``), a constant 1
  (dim ``_CONST``) and a "tools" channel (dim ``_MODE``). The one layer's MLP is zero;
  its attention has a constant query (read from ``_CONST``) and a key only on the
  ``<tools>`` token, so every position after a ``<tools>`` token attends to it (score
  40, the rest 0) and copies 1.0 into the tools
  channel; without one the values are all zero. The query/key sit in the last rotary pair
  of the head, whose angle (``rope_theta`` 1e6) stays below 1e-3 over the whole context,
  so the match does not depend on distance.
* ``lm_head`` is a bigram table — the next token is a function of the current one — with
  one exception: after the assistant header's ``\\n`` the tools channel tips the choice
  from the plain reply to the tool call. Unlisted tokens are followed by end of text.

What it therefore answers (``EXPECTED``): a chat reply ``Hello from tiny Hermes!``; with
``tools`` in the request ``<tool_call>{"name": "get_weather", "arguments": {"city":
"Paris"}}</tool_call>`` (the hermes parser's format); the completion of ``Once upon`` is
`` a time, the model spoke.``. Prompts are split on words; words outside the vocabulary are
``<unk>``, one token each, so a prompt of N unknown words is N tokens (plus the template).

Run ``python -m heteroflow.models.tiny_hf DIR`` to write it from a shell.
"""

from __future__ import annotations

import itertools
import json
import os
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

__all__ = ["EXPECTED", "TINY_HF_DIR_NAME", "main", "write_tiny_hf"]

TINY_HF_DIR_NAME = "tiny-hermes"  # "hermes" in the name: the registry's hermes family

_HIDDEN = 128
_HEADS = 2
_HEAD_DIM = _HIDDEN // _HEADS
_FF = 64
_VOCAB = 96  # the one-hot needs vocab <= hidden - 2 (the two channels below)
_MODE = _HIDDEN - 1  # the tools channel
_CONST = _HIDDEN - 2  # 1.0 in every token's embedding: where the constant query reads
_MAX_LEN = 512
_STEP = 4.0  # a listed transition's logit (before the final norm's scale of ~11)

EXPECTED = {
    "chat": "Hello from tiny Hermes!",
    "tool_name": "get_weather",
    "tool_arguments": {"city": "Paris"},
    "completion_prompt": "Once upon",
    "completion": " a time, the model spoke.",
}

_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_TOOLS_TOKEN = "<tools>"  # noqa: S105 - a vocabulary entry
_PLAIN_ADDED = [_TOOLS_TOKEN, "</tools>", "<tool_call>", "</tool_call>"]
_CHAT = ["Hello", " from", " tiny", " Hermes", "!"]
_CALL = ['{"name": ', '"get_weather"', ', "arguments": ', '{"city": ', '"Paris"', "}}"]
_STORY = [" upon", " a", " time", ",", " the", " model", " spoke", "."]
_WORDS = ["<unk>", "\n", "system", "user", "assistant", "tool", "Once", " call", " functions"]

_CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.<tools>"
    "{%- for tool in tools %}{{ tool | tojson }}{%- endfor %}</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content if message.content is string else '' }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> dict[str, int]:
    words: list[str] = []
    for w in [*_WORDS, *_CHAT, *_CALL, *_STORY]:
        if w not in words:
            words.append(w)
    vocab = {w: i for i, w in enumerate(words)}
    for t in [*_SPECIAL, *_PLAIN_ADDED]:
        vocab[t] = len(vocab)
    assert len(vocab) <= _VOCAB
    return vocab


def _tokenizer(vocab: dict[str, int]) -> Tokenizer:
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))  # noqa: S106
    # words keep their leading space (decoding concatenates: Fuse), "\n" stands alone
    split = Regex(r"\n| ?[A-Za-z_]+| ?[0-9]+| ?[^\sA-Za-z0-9_]+|\s+")
    tok.pre_tokenizer = pre_tokenizers.Split(split, behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL])
    # not special: the tool-call markers must survive skip_special_tokens for the parser
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _PLAIN_ADDED])
    return tok


def _chains(v: dict[str, int]) -> dict[int, int]:
    """token -> next token (greedy); the assistant header's "\\n" is handled apart."""
    nxt: dict[int, int] = {}
    for seq, end in (
        (_CHAT, "<|im_end|>"),
        (["<tool_call>", *_CALL, "</tool_call>"], "<|im_end|>"),
        (["Once", *_STORY], "<|endoftext|>"),
    ):
        ids = [v[t] for t in seq] + [v[end]]
        nxt.update(itertools.pairwise(ids))
    return nxt


def _weights(v: dict[str, int], layers: int = 1) -> dict[str, npt.NDArray[np.float32]]:
    f32 = np.float32
    embed = np.zeros((_VOCAB, _HIDDEN), f32)
    embed[np.arange(_VOCAB), np.arange(_VOCAB)] = 1.0  # one-hot (padding rows unused)
    embed[:, _CONST] = 1.0
    q = np.zeros((_HIDDEN, _HIDDEN), f32)
    k = np.zeros((_HIDDEN, _HIDDEN), f32)
    val = np.zeros((_HIDDEN, _HIDDEN), f32)
    o = np.zeros((_HIDDEN, _HIDDEN), f32)
    last = _HEAD_DIM // 2 - 1  # the slowest rotary pair of head 0
    norm_scale = float(np.sqrt(_HIDDEN / 2))  # RMSNorm of one-hot + constant: 8
    q[last, _CONST] = 5.0  # q = 40 everywhere; k = 8 on <tools>: 40 * 8 / sqrt(64)
    k[last, v[_TOOLS_TOKEN]] = 1.0
    val[0, v[_TOOLS_TOKEN]] = 1.0
    o[_MODE, 0] = 1.0 / norm_scale  # the tools channel gets 1.0
    head = np.zeros((_VOCAB, _HIDDEN), f32)
    head[v["<|endoftext|>"], :_VOCAB] = _STEP  # unlisted tokens end the text
    for cur, nxt in _chains(v).items():
        head[v["<|endoftext|>"], cur] = 0.0
        head[nxt, cur] = _STEP
    nl = v["\n"]
    head[v["<|endoftext|>"], nl] = 0.0
    head[v["Hello"], nl] = _STEP
    head[v["<tool_call>"], nl] = _STEP - 1
    head[v["<tool_call>"], _MODE] = 2.0  # with tools: 3 + 2 beats 4
    ones = np.ones(_HIDDEN, f32)
    p = "model.layers.0."
    tensors = {
        "model.embed_tokens.weight": embed,
        p + "input_layernorm.weight": ones,
        p + "post_attention_layernorm.weight": ones.copy(),
        p + "self_attn.q_proj.weight": q,
        p + "self_attn.k_proj.weight": k,
        p + "self_attn.v_proj.weight": val,
        p + "self_attn.o_proj.weight": o,
        p + "mlp.gate_proj.weight": np.zeros((_FF, _HIDDEN), f32),
        p + "mlp.up_proj.weight": np.zeros((_FF, _HIDDEN), f32),
        p + "mlp.down_proj.weight": np.zeros((_HIDDEN, _FF), f32),
        "model.norm.weight": ones.copy(),
        "lm_head.weight": head,
    }
    for n in range(1, layers):  # pass-through layers: zero outputs leave the residual as is
        tensors |= {
            f"model.layers.{n}.{name}": np.zeros_like(tensors[p + name])
            for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                         "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
        } | {
            f"model.layers.{n}.input_layernorm.weight": ones.copy(),
            f"model.layers.{n}.post_attention_layernorm.weight": ones.copy(),
        }
    return tensors


def _safetensors(tensors: dict[str, npt.NDArray[np.float32]]) -> bytes:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, arr in tensors.items():
        data = np.ascontiguousarray(arr, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def _config(v: dict[str, int], layers: int = 1) -> dict[str, object]:
    eos = [v["<|im_end|>"], v["<|endoftext|>"]]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_size": _HIDDEN,
        "intermediate_size": _FF,
        "num_hidden_layers": layers,
        "num_attention_heads": _HEADS,
        "num_key_value_heads": _HEADS,
        "head_dim": _HEAD_DIM,
        "hidden_act": "silu",
        "max_position_embeddings": _MAX_LEN,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": _VOCAB,
        "bos_token_id": v["<|endoftext|>"],
        "eos_token_id": eos,
    }


def write_tiny_hf(directory: Path, layers: int = 1) -> Path:
    """Write the model into ``directory`` (created; files replaced atomically) and return it.
    ``layers`` > 1 adds pass-through layers (every projection zero: the residual stream
    goes through unchanged, so the answers stay ``EXPECTED``): a pipeline of N stages
    needs N layers, since vLLM splits the layers between the stages and a stage given
    none has no KV cache to size (ZeroDivisionError at start)."""
    directory.mkdir(parents=True, exist_ok=True)
    v = _vocab()
    files: dict[str, bytes] = {
        "config.json": json.dumps(_config(v, layers), indent=1).encode(),
        "generation_config.json": json.dumps(
            {"eos_token_id": [v["<|im_end|>"], v["<|endoftext|>"]],
             "bos_token_id": v["<|endoftext|>"], "do_sample": False}
        ).encode(),
        "tokenizer.json": _tokenizer(v).to_str().encode(),
        "tokenizer_config.json": json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": "<unk>",
                "model_max_length": _MAX_LEN,
                "clean_up_tokenization_spaces": False,
                "chat_template": _CHAT_TEMPLATE,
            },
            indent=1,
        ).encode(),
        "model.safetensors": _safetensors(_weights(v, layers)),
    }
    for name, data in files.items():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # readable by an engine running as another user (a container)
        os.replace(tmp, directory / name)
    return directory


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m heteroflow.models.tiny_hf DIR", file=sys.stderr)
        return 2
    print(write_tiny_hf(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
