"""Capabilities per service (issue 15 item 2): derived from engine, final args and model files.

GGUF models are written with the ``gguf`` package into tmp_path and read through the
server's reading path (``models.capabilities.model_facts``); Hugging Face models are
config.json directories.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from heteroflow.core.engines import LaunchShape, build_command, process_argv
from heteroflow.core.engines.capabilities import (
    LAUNCHER_DEFAULT_CTX,
    UNKNOWN,
    Capabilities,
    ModelFacts,
    derive,
    facts_from_hf,
    merge,
)
from heteroflow.core.engines.mindie import MAX_SEQ_LEN as MINDIE_MAX_SEQ_LEN
from heteroflow.engines.llamacpp_server import DEFAULT_CTX_SIZE
from heteroflow.models.capabilities import model_facts
from heteroflow.models.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.feature("M13")

TOOLS_TEMPLATE = (
    "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}{{ tools }}{% endif %}"
)
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


def write_gguf(path: Path, arch: str = "llama", **kv: Any) -> Path:
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(kv.get("ctx", 8192))
    w.add_embedding_length(kv.get("embd", 256))
    if "template" in kv:
        w.add_chat_template(kv["template"])
    if "tool_use" in kv:
        w.add_string("tokenizer.chat_template.tool_use", kv["tool_use"])
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def write_hf(directory: Path, config: dict[str, Any], template: Any = None) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    tok: dict[str, Any] = {} if template is None else {"chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(tok))
    return directory


def llamacpp_args(model: Path, *extra: str) -> list[str]:
    shape = LaunchShape("llamacpp", str(model), "m", 8000, gpus=0, extra_args=extra)
    return process_argv(shape, "/venv/python")


def test_gguf_with_a_tool_template_under_our_llamacpp_command(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "m.gguf", template=TOOLS_TEMPLATE, ctx=2048, embd=128)
    facts = model_facts(str(model))
    assert facts == ModelFacts("llama", (TOOLS_TEMPLATE,), 2048, 128, False, None)
    caps = derive("llamacpp", llamacpp_args(model), facts)
    # launcher default 4096, capped at the trained 2048; no --embeddings, no --mmproj
    assert caps == Capabilities(
        chat=True, tools=True, vision=False, embeddings=False, json_schema=True,
        context_length=2048, embedding_dimensions=None,
    )  # fmt: skip
    with_flags = derive("llamacpp", llamacpp_args(model, "--embeddings", "-c", "1024"), facts)
    assert (with_flags.embeddings, with_flags.embedding_dimensions) == (True, 128)
    assert with_flags.context_length == 1024


def test_the_tiny_models_plain_chatml_template_has_no_tools(tmp_path: Path) -> None:
    plain = write_tiny_gguf(tmp_path / "tiny.gguf")
    tools = write_tiny_gguf(tmp_path / "tiny-tools.gguf", tools=True)
    assert derive("llamacpp", llamacpp_args(plain), model_facts(str(plain))).tools is False
    assert derive("llamacpp", llamacpp_args(tools), model_facts(str(tools))).tools is True


def test_llamacpp_flags_decide_tools_and_vision(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "m.gguf", template=PLAIN_TEMPLATE, tool_use=TOOLS_TEMPLATE)
    facts = model_facts(str(model))
    assert facts is not None and facts.template_tools  # the named tool_use template counts
    assert derive("llamacpp", ["-m", str(model)], facts).tools is True
    assert derive("llamacpp", ["-m", "x", "--jinja", "--no-jinja"], facts).tools is False
    assert derive("llamacpp", ["-m", "x", "--chat-template", PLAIN_TEMPLATE], facts).tools is False
    assert derive("llamacpp", ["-m", "x", "--chat-template", "chatml"], facts).tools is None
    assert derive("llamacpp", ["-m", "x", "--chat-template-file", "/t"], facts).tools is None
    assert derive("llamacpp", ["-m", "x", "--mmproj", "/p.gguf"], facts).vision is True
    no_pooling = ["-m", "x", "--embeddings", "--pooling", "none"]
    assert derive("llamacpp", no_pooling, facts).embeddings is False
    # model files not readable here: what only the model can say is unknown
    unread = derive("llamacpp", ["-m", "/elsewhere.gguf", "-c", "0"], None)
    assert (unread.chat, unread.tools, unread.context_length) == (None, None, None)
    assert (unread.embeddings, unread.vision) == (False, False)


def test_an_encoder_gguf_serves_embeddings_never_chat(tmp_path: Path) -> None:
    model = write_gguf(tmp_path / "bge.gguf", arch="bert", ctx=512, embd=384)
    caps = derive("llamacpp", ["-m", str(model), "--embeddings"], model_facts(str(model)))
    assert (caps.chat, caps.tools, caps.vision, caps.json_schema) == (False, False, False, False)
    assert (caps.embeddings, caps.embedding_dimensions, caps.context_length) == (True, 384, 512)


def test_hf_directories_for_vllm_and_sglang(tmp_path: Path) -> None:
    qwen = write_hf(
        tmp_path / "Qwen2.5-7B-Instruct",
        {"architectures": ["Qwen2ForCausalLM"], "max_position_embeddings": 32768,
         "hidden_size": 3584},
        "{% if tools %}...{% endif %}",
    )  # fmt: skip
    facts = model_facts(str(qwen))
    shape = LaunchShape("vllm", str(qwen), "qwen", 8000)
    caps = derive("vllm", build_command(shape).args, facts)
    assert caps == Capabilities(
        chat=True, tools=True, vision=False, embeddings=False, json_schema=True,
        context_length=32768, embedding_dimensions=None,
    )  # fmt: skip
    limited = derive("vllm", ["--max-model-len", "8k", "--enable-auto-tool-choice"], facts)
    assert (limited.context_length, limited.tools) == (8000, False)  # no parser: no tools
    sglang_args = build_command(LaunchShape("sglang", str(qwen), "q", 8000)).args
    sglang = derive("sglang", sglang_args, facts)
    assert (sglang.tools, sglang.context_length) == (True, 32768)
    pooled = derive("vllm", ["--task", "embed"], facts)
    assert (pooled.chat, pooled.tools, pooled.embeddings, pooled.embedding_dimensions) == (
        False, False, True, 3584,
    )  # fmt: skip


def test_hf_vision_and_encoder_models(tmp_path: Path) -> None:
    vl = write_hf(
        tmp_path / "vl",
        {"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {},
         "text_config": {"max_position_embeddings": 4096, "hidden_size": 64}},
        [{"name": "default", "template": "x"}, {"name": "tool_use", "template": "tools"}],
    )  # fmt: skip
    facts = model_facts(str(vl))
    assert facts is not None and facts.template_tools and facts.context_length == 4096
    assert derive("vllm", [], facts).vision is True
    bert = facts_from_hf({"architectures": ["BertModel"], "max_position_embeddings": 512})
    caps = derive("vllm", [], bert)
    assert (caps.chat, caps.embeddings, caps.context_length) == (False, True, 512)
    assert derive("sglang", ["--is-embedding"], None).chat is False
    assert derive("vllm", [], facts_from_hf({"architectures": ["Strange"]})).chat is None


def test_separate_chat_template_file_is_read(tmp_path: Path) -> None:
    d = write_hf(tmp_path / "m", {"architectures": ["LlamaForCausalLM"]})
    (d / "chat_template.jinja").write_text("{% if tools %}{% endif %}")
    facts = model_facts(str(d))
    assert facts is not None and facts.template_tools


def test_unknown_engines_and_unreadable_paths() -> None:
    assert derive("", ["whatever"], None) == UNKNOWN
    assert not UNKNOWN.known
    assert model_facts("/nonexistent/model.gguf") is None
    assert model_facts("../escape") is None
    assert model_facts("") is None
    fixed = derive("mindie", [], None)
    assert (fixed.chat, fixed.embeddings, fixed.tools, fixed.context_length) == (
        True, False, None, MINDIE_MAX_SEQ_LEN,
    )  # fmt: skip


def test_a_corrupt_gguf_reads_as_unknown(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 10)
    assert model_facts(str(bad)) is None


def test_merge_absent_only_when_every_target_lacks_it() -> None:
    a = Capabilities(chat=True, tools=False, vision=False, context_length=4096)
    b = Capabilities(chat=True, tools=True, vision=None, context_length=8192)
    m = merge([a, b])
    assert (m.chat, m.tools, m.vision, m.context_length) == (True, True, None, 8192)
    assert merge([a, Capabilities(tools=False, vision=False, context_length=None)]).vision is False
    assert merge([a, UNKNOWN]).context_length is None


def test_launcher_default_context_is_the_launchers() -> None:
    assert LAUNCHER_DEFAULT_CTX == DEFAULT_CTX_SIZE


def test_wire_form_roundtrips() -> None:
    caps = Capabilities(True, False, None, True, True, 2048, 64)
    assert Capabilities.from_wire(json.loads(json.dumps(caps.to_wire()))) == caps
    assert Capabilities.from_wire(None) == UNKNOWN
