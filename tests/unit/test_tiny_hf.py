"""The tiny Hugging Face model (models/tiny_hf.py): written fast, tokenised as documented,
the registry's hermes family, and — by a plain numpy forward pass of a Llama over the
written files — the answers ``EXPECTED`` promises. tests/e2e/test_vllm_real.py gets the
same answers from the real vLLM."""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import jinja2
import numpy as np
import numpy.typing as npt
import pytest
from tokenizers import Tokenizer

from heteroflow.core.engines.tool_parsers import command_args, family_of
from heteroflow.models.tiny_hf import EXPECTED, TINY_HF_DIR_NAME, write_tiny_hf

F32 = npt.NDArray[np.float32]
TOOLS: list[dict[str, object]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    started = time.monotonic()
    d = write_tiny_hf(tmp_path_factory.mktemp("m") / TINY_HF_DIR_NAME)
    assert time.monotonic() - started < 2.0
    return d


def tensors(path: Path) -> dict[str, F32]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__")
    data = raw[8 + n :]
    out: dict[str, F32] = {}
    for name, h in header.items():
        a, b = h["data_offsets"]
        out[name] = np.frombuffer(data[a:b], "<f4").reshape(h["shape"])
    return out


def rms(x: F32, w: F32, eps: float) -> F32:
    out: F32 = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w
    return out


def rope(x: F32, theta: float) -> F32:  # (seq, heads, dim), HF's rotate_half layout
    seq, _, dim = x.shape
    inv = theta ** (-np.arange(0, dim, 2) / dim)
    ang = np.outer(np.arange(seq), inv)
    cos = np.concatenate([np.cos(ang)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(ang)] * 2, -1)[:, None, :]
    half = dim // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    out: F32 = (x * cos + rot * sin).astype(np.float32)
    return out


def next_token(w: dict[str, F32], cfg: dict[str, object], ids: list[int]) -> int:
    eps, theta = float(cfg["rms_norm_eps"]), float(cfg["rope_theta"])  # type: ignore[arg-type]
    heads, dim = int(cfg["num_attention_heads"]), int(cfg["head_dim"])  # type: ignore[call-overload]
    p = "model.layers.0."
    x = w["model.embed_tokens.weight"][ids]
    h = rms(x, w[p + "input_layernorm.weight"], eps)
    q = rope((h @ w[p + "self_attn.q_proj.weight"].T).reshape(len(ids), heads, dim), theta)
    k = rope((h @ w[p + "self_attn.k_proj.weight"].T).reshape(len(ids), heads, dim), theta)
    v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(len(ids), heads, dim)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(dim)
    scores += np.triu(np.full((len(ids), len(ids)), -np.inf), 1)
    att = np.exp(scores - scores.max(-1, keepdims=True))
    att /= att.sum(-1, keepdims=True)
    o = np.einsum("hqk,khd->qhd", att, v).reshape(len(ids), heads * dim)
    x = x + o @ w[p + "self_attn.o_proj.weight"].T
    m = rms(x, w[p + "post_attention_layernorm.weight"], eps)
    gate = m @ w[p + "mlp.gate_proj.weight"].T
    x = x + ((gate / (1 + np.exp(-gate))) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"
    ].T
    logits = rms(x, w["model.norm.weight"], eps)[-1] @ w["lm_head.weight"].T
    return int(np.argmax(logits))


def generate(model: Path, ids: list[int], tok: Tokenizer) -> str:
    w = tensors(model / "model.safetensors")
    cfg = json.loads((model / "config.json").read_text())
    stops = set(cfg["eos_token_id"])
    out: list[int] = []
    while len(out) < 30:
        nxt = next_token(w, cfg, ids + out)
        if nxt in stops:
            break
        out.append(nxt)
    return tok.decode(out, skip_special_tokens=True)


def chat_prompt(model: Path, tools: list[dict[str, object]] | None) -> str:
    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    return jinja2.Environment(autoescape=False).from_string(template).render(  # noqa: S701 - not HTML
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools, add_generation_prompt=True,
    )


def test_the_tiny_model_answers_what_it_promises(model: Path) -> None:
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    plain = chat_prompt(model, None)
    assert plain.endswith("<|im_start|>assistant\n") and "<tools>" not in plain
    assert generate(model, tok.encode(plain).ids, tok) == EXPECTED["chat"]
    call = generate(model, tok.encode(chat_prompt(model, TOOLS)).ids, tok)
    body = json.loads(call.removeprefix("<tool_call>").removesuffix("</tool_call>"))
    assert body == {"name": EXPECTED["tool_name"], "arguments": EXPECTED["tool_arguments"]}
    prompt = str(EXPECTED["completion_prompt"])
    assert generate(model, tok.encode(prompt).ids, tok) == EXPECTED["completion"]


def test_its_files_its_tokens_and_its_tool_parser(model: Path) -> None:
    names = {p.name for p in model.iterdir()}
    assert names == {"config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "model.safetensors"}
    assert sum(p.stat().st_size for p in model.iterdir()) < 1_000_000
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert len(tok.encode(" ".join(["x"] * 300)).ids) == 300  # an unknown word: one token
    assert tok.encode("<|im_start|>assistant\n").tokens == ["<|im_start|>", "assistant", "\n"]
    family = family_of(str(model))
    assert family is not None and family.vllm == "hermes"
    assert command_args("vllm", str(model), ()) == (
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes"
    )
