"""The tool-call parser each engine needs per model family, as data (issue 15 item 3).

vLLM returns ``tool_calls`` only when started with ``--enable-auto-tool-choice
--tool-call-parser NAME``, SGLang with ``--tool-call-parser NAME``; the parser must match
the format the model family writes its calls in. ``command_args`` adds them for a model
whose path names a known family, unless the task's own ``engine_args`` already choose
(any ``--tool-call-parser`` or ``--enable-auto-tool-choice``: theirs wins, ours is not
added) or the task serves embeddings. A family we do not know gets nothing: the service's
capabilities then say "no tools" and the gateway answers such requests with a 400.

Names checked against the engines' docs (stored copies read through the search tool):
vLLM docs/features/tool_calling.md (``hermes`` for Hermes and Qwen2.5/QwQ, per Qwen's own
docs also Qwen3; ``llama3_json`` for Llama 3.1-3.3; ``llama4_pythonic`` for Llama 4;
``mistral``; ``deepseek_v3``; ``deepseek_v31``; ``granite``; ``internlm``; ``jamba``;
``kimi_k2``; ``glm45``; ``openai`` for gpt-oss; ``qwen3_coder`` registered since 0.10.2).
SGLang ``FunctionCallParser.ToolCallParserEnum`` (python/sglang/srt/function_call/
function_call_parser.py) and docs/advanced_features/tool_parser.md: ``qwen25`` (newer
releases also call it ``qwen`` and accept the old name), ``qwen3_coder``, ``llama3``,
``pythonic`` (Llama 4; ``llama4`` only in some releases), ``mistral``, ``deepseekv3``,
``deepseekv31``, ``kimi_k2``, ``glm45``, ``gpt-oss``. Families without an SGLang parser
(Hermes, Granite, InternLM, Jamba) get none there.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["TOOL_PARSERS", "ToolParser", "command_args", "family_of"]


@dataclass(frozen=True)
class ToolParser:
    """One model family: the pattern its model path matches, and each engine's parser."""

    family: str
    pattern: re.Pattern[str]
    vllm: str | None
    sglang: str | None


def _p(family: str, pattern: str, vllm: str | None, sglang: str | None) -> ToolParser:
    return ToolParser(family, re.compile(pattern), vllm, sglang)


# First match wins, so the more specific pattern comes first (a Hermes fine-tune of Llama,
# Qwen3-Coder before Qwen, DeepSeek-V3.1 before V3). Matched on the lower-cased path.
TOOL_PARSERS: tuple[ToolParser, ...] = (
    _p("qwen3-coder", r"qwen3-coder", "qwen3_coder", "qwen3_coder"),
    _p("hermes", r"hermes", "hermes", None),
    _p("qwen", r"qwen|qwq", "hermes", "qwen25"),
    _p("llama4", r"llama-?4", "llama4_pythonic", "pythonic"),
    _p("llama3", r"llama-?3", "llama3_json", "llama3"),
    _p("mistral", r"mistral|mixtral|ministral", "mistral", "mistral"),
    _p("deepseek-v3.1", r"deepseek-v3[.-]1", "deepseek_v31", "deepseekv31"),
    _p("deepseek-v3", r"deepseek-v3", "deepseek_v3", "deepseekv3"),
    _p("granite", r"granite", "granite", None),
    _p("internlm", r"internlm", "internlm", None),
    _p("jamba", r"jamba", "jamba", None),
    _p("kimi-k2", r"kimi-k2", "kimi_k2", "kimi_k2"),
    _p("glm-4.5", r"glm-4\.[56]", "glm45", "glm45"),
    _p("gpt-oss", r"gpt-oss", "openai", "gpt-oss"),
)

_CHOOSING = ("--tool-call-parser", "--enable-auto-tool-choice")
_POOLING_PAIRS = {("--task", "embed"), ("--task", "embedding"), ("--runner", "pooling")}
_POOLING_PAIRS |= {("--convert", "embed")}


def family_of(model_path: str) -> ToolParser | None:
    """The family whose pattern the model path (its last two parts: org/name) matches."""
    tail = "/".join(model_path.lower().rstrip("/").split("/")[-2:])
    return next((p for p in TOOL_PARSERS if p.pattern.search(tail)), None)


def _chooses(extra_args: Sequence[str]) -> bool:
    return any(a.partition("=")[0].replace("_", "-") in _CHOOSING for a in extra_args)


def _pools(extra_args: Sequence[str]) -> bool:
    """The task's own arguments make it an embedding server (vLLM / SGLang spellings)."""
    words = [w for a in extra_args for w in a.replace("_", "-").split("=")]
    pairs = set(itertools.pairwise(words))
    return "--is-embedding" in words or bool(pairs & _POOLING_PAIRS)


def command_args(
    engine: str, model_path: str, extra_args: Sequence[str], *, embeddings: bool = False
) -> tuple[str, ...]:
    """The flags that switch tool calling on for ``engine`` serving ``model_path``; empty
    when the task chooses itself, serves embeddings, or the family is unknown."""
    if embeddings or _chooses(extra_args) or _pools(extra_args):
        return ()
    family = family_of(model_path)
    if family is None:
        return ()
    if engine in ("vllm", "vllm-mtt") and family.vllm:
        return ("--enable-auto-tool-choice", "--tool-call-parser", family.vllm)
    if engine == "sglang" and family.sglang:
        return ("--tool-call-parser", family.sglang)
    return ()
