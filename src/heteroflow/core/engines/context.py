"""The context an engine will run with, read from its own command-line flag.

Each engine's record in ``registry`` names its context flag (:class:`ContextFlag`: the
spellings and how that engine's parser reads a value); :func:`engine_context` reads the
arguments a task passes (``engine_args``, or a custom ``command``) the way that engine
would: the last occurrence wins, ``--flag=value`` only where the engine's parser takes it,
``_`` for ``-`` in ``--`` flags where it does (vLLM's parser, llama.cpp's ``common/arg.cpp``).
The memory estimate (``core.estimate``) sizes the KV cache for the answer.

Sources for what a value means:

* llama.cpp ``-c, --ctx-size N``: "size of the prompt context (default: 0, 0 = loaded
  from model)" (llama-server --help, tests/data/llama-server-help.txt). HeteroFlow's
  process-runtime launcher defaults to 4096 instead when no ``-c`` is given; the official
  image's llama-server loads it from the model, and an estimate must hold for both, so no
  ``-c`` counts as the model's trained length.
* vLLM ``--max-model-len``: ``human_readable_int`` of vllm/engine/arg_utils.py (0.11):
  ``25.6k`` = 25,600 (lower-case suffixes are decimal), ``1K`` = 1,024 (upper-case are
  binary); ``-1`` / ``auto`` (later releases) size it to what fits, at most the model's
  own length. Default: the model's ``max_position_embeddings``.
* SGLang ``--context-length`` (docs/advanced_features/server_arguments.md): an integer;
  default from the model's config.
* TensorRT-LLM ``trtllm-serve --max_seq_len`` (tensorrt_llm/commands/serve.py, click):
  an integer; default from the model (or the built engine).
* MindIE: no flags; our generated ``config.json`` sets ``maxSeqLen``
  (:data:`heteroflow.core.engines.mindie.MAX_SEQ_LEN`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_HUMAN = re.compile(r"(\d+(?:\.\d+)?)([A-Za-z]*)")
_DECIMAL = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_BINARY.update({f"{k}i": v for k, v in list(_BINARY.items())})


@dataclass(frozen=True)
class ContextFlag:
    """How an engine's command line sets its context length (tokens)."""

    spellings: tuple[str, ...]  # e.g. ("-c", "--ctx-size"); the first is the one shown
    equals_form: bool = True  # --flag=value is read (argparse, click; not llama.cpp)
    underscores: bool = False  # --ctx_size reads as --ctx-size (vLLM, llama.cpp)
    human_ints: bool = False  # vLLM: 32k, 1K, -1 / auto
    zero_is_model: bool = False  # llama.cpp: -c 0 = the model's trained length


@dataclass(frozen=True)
class EngineContext:
    """What the engine's arguments say: ``tokens`` None means the model's own trained
    length (llama.cpp ``-c 0``, vLLM ``auto``), which is then not capped."""

    tokens: int | None
    source: str  # how it is known, for the estimate's detail: "-c", "--max-model-len 32k"


def _name(arg: str, flag: ContextFlag) -> str:
    if flag.underscores and arg.startswith("--"):
        return arg.replace("_", "-")
    return arg


def _tokens(text: str, flag: ContextFlag) -> int | None:
    """The tokens a value means (None: the model's own length); ValueError when the
    engine would refuse it."""
    if flag.human_ints:
        if text in ("-1", "auto"):
            return None
        m = _HUMAN.fullmatch(text)
        if m is None:
            raise ValueError(text)
        number, suffix = m[1], m[2]
        if suffix in _DECIMAL:
            tokens = int(float(number) * _DECIMAL[suffix])
        elif suffix in _BINARY and "." not in number:
            tokens = int(number) * _BINARY[suffix]
        else:
            raise ValueError(text)
    elif text.isdigit():
        tokens = int(text)
    else:
        raise ValueError(text)
    if tokens == 0:
        if flag.zero_is_model:
            return None
        raise ValueError(text)
    return tokens


def names_flag(flag: ContextFlag, args: Sequence[str]) -> bool:
    """Whether ``args`` name the context flag at all (whatever the value)."""
    spellings = set(flag.spellings)
    for arg in args:
        if _name(arg, flag) in spellings:
            return True
        if "=" in arg and _name(arg.partition("=")[0], flag) in spellings:
            return True  # also where the engine refuses the form: it is not "unset"
    return False


def read_context(flag: ContextFlag, args: Sequence[str]) -> EngineContext | None:
    """The context ``args`` set through ``flag`` (the last occurrence wins); None when
    they do not set it, or set it to something the engine would refuse."""
    found: tuple[str, str] | None = None
    spellings = set(flag.spellings)
    for i, arg in enumerate(args):
        name = _name(arg, flag)
        if name in spellings and i + 1 < len(args):
            found = (name, args[i + 1])
        elif flag.equals_form and "=" in arg:
            head, _, value = arg.partition("=")
            if _name(head, flag) in spellings:
                found = (_name(head, flag), value)
    if found is None:
        return None
    name, text = found[0], found[1].strip()
    try:
        tokens = _tokens(text, flag)
    except ValueError:
        return None
    if tokens is None:
        return EngineContext(None, f"{name} {text}")
    return EngineContext(tokens, name if text == str(tokens) else f"{name} {text}")
