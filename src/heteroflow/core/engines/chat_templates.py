"""The chat template a llama.cpp service runs with when its GGUF carries none (issue 33).

llama.cpp renders a chat with the GGUF's ``tokenizer.chat_template``, or the one given
with ``--chat-template``; without either it falls back to ChatML (``<|im_start|>`` /
``<|im_end|>``), which a model of another family was never trained on: Gemma 3 270M's
GGUF (the demo's) has no template, and a user's service of it answered with ChatML
tokens while the demo, which passed Gemma's own format itself, did not. One rule for
every llama.cpp service: a GGUF without a template whose architecture has a known turn
format gets that format as ``--chat-template`` (its Jinja text: llama-server resolves a
built-in name only without ``--jinja``, and our launcher, on xllamacpp, never), unless
the task's arguments choose one. Pure: the caller reads the GGUF's metadata.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["GEMMA_CHAT_TEMPLATE", "TEMPLATE_FLAGS", "chat_template_args", "fallback_template"]

#: Gemma's own turn format (``<start_of_turn>role … <end_of_turn>``; the assistant is
#: ``model``), for Gemma, Gemma 2 and Gemma 3 GGUFs that carry no template.
GEMMA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
    "{% else %}{% set role = message['role'] %}{% endif %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# general.architecture -> the family's turn format
_BY_ARCHITECTURE: Mapping[str, str] = {
    "gemma": GEMMA_CHAT_TEMPLATE,
    "gemma2": GEMMA_CHAT_TEMPLATE,
    "gemma3": GEMMA_CHAT_TEMPLATE,
}

#: the flags by which a task chooses its own template (llama-server's spellings)
TEMPLATE_FLAGS = frozenset({"--chat-template", "--chat-template-file"})


def fallback_template(meta: Mapping[str, Any]) -> str | None:
    """The template a GGUF with metadata ``meta`` needs passed: None when it carries its
    own (``tokenizer.chat_template``), or when its family has no known format (llama.cpp's
    ChatML fallback then stands)."""
    if any(
        k == "tokenizer.chat_template" or k.startswith("tokenizer.chat_template.") for k in meta
    ):
        return None
    arch = meta.get("general.architecture")
    return _BY_ARCHITECTURE.get(arch) if isinstance(arch, str) else None


def chat_template_args(
    engine: str, args: Sequence[str], meta: Mapping[str, Any] | None
) -> tuple[str, ...]:
    """What a llama.cpp command adds for the model of metadata ``meta`` (None: the model
    could not be read here, nothing is added): ``--chat-template <text>`` per
    ``fallback_template``, unless ``args`` set a template themselves."""
    if engine != "llamacpp" or meta is None:
        return ()
    if any(a in TEMPLATE_FLAGS or a.split("=", 1)[0] in TEMPLATE_FLAGS for a in args):
        return ()
    text = fallback_template(meta)
    return ("--chat-template", text) if text else ()
