"""What a served model can do (issue 15 item 2): derived from the engine, the arguments it
runs with and the model's own metadata; pure (the file reading is ``models.capabilities``).

Every capability is three-valued: ``True`` known present, ``False`` known absent, ``None``
unknown (a custom command, a model whose files the server cannot read, an engine whose
support we have not pinned). The gateway refuses a request only for a capability known
absent, so an unknown never costs a caller a working request.

What each engine needs (the flags are read from the final argument list, last one wins):

* llama.cpp: embeddings only with ``--embedding(s)``; images only with a projector
  (``--mmproj``); tools with the Jinja template engine (``--jinja``, the default of current
  builds, off with ``--no-jinja``) AND a chat template that renders ``tools`` (the model's
  ``tokenizer.chat_template`` or a named ``tokenizer.chat_template.*`` one, or
  ``--chat-template``): measured with xllamacpp 2026.10, a template without tools makes the
  server ignore ``tools`` (format "Content-only") and answer plain text; JSON schema output
  through its grammar sampler; context ``-c`` (0 = the model's), our process launcher
  defaulting to :data:`LAUNCHER_DEFAULT_CTX`; never beyond the model's trained length
  (llama-server caps the slot context at it). Encoder-only GGUF architectures (BERT
  family) serve embeddings, never chat.
* vLLM: a pooling model (``--task embed``, ``--runner pooling``, ``--convert embed``, or an
  encoder architecture such as ``BertModel``) serves embeddings and no chat; tools need
  ``--enable-auto-tool-choice`` and ``--tool-call-parser``; images a vision model
  (``vision_config`` in config.json); JSON schema through guided decoding; context
  ``--max-model-len`` else the model's ``max_position_embeddings``.
* SGLang: ``--is-embedding`` for embeddings; tools need ``--tool-call-parser``; the rest
  as vLLM, context ``--context-length``.
* TensorRT-LLM and MindIE: chat, no embeddings (our command lines refuse them); tools,
  images and JSON schema unknown.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from heteroflow.core.engines.commands import LLAMACPP_LAUNCHER
from heteroflow.core.engines.registry import engine_context

__all__ = [
    "ENCODER_GGUF_ARCHS",
    "LAUNCHER_DEFAULT_CTX",
    "UNKNOWN",
    "Capabilities",
    "ModelFacts",
    "derive",
    "facts_from_gguf",
    "facts_from_hf",
    "merge",
]

# heteroflow.engines.llamacpp_server's ctx default when no -c is given (a test pins it).
LAUNCHER_DEFAULT_CTX = 4096
# GGUF architectures (gguf.MODEL_ARCH_NAMES) that are encoders: embeddings, never chat.
ENCODER_GGUF_ARCHS = frozenset(
    {
        "bert", "eurobert", "gemma-embedding", "jina-bert-v2", "jina-bert-v3", "llama-embed",
        "modern-bert", "neo-bert", "nomic-bert", "nomic-bert-moe", "t5encoder",
    }
)  # fmt: skip
# Hugging Face architecture suffixes: generative heads, and pooling (embedding) ones.
_GENERATIVE = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
_POOLING = ("Model", "ForSequenceClassification", "ForTokenClassification", "ForMaskedLM")
_VISION_KEYS = ("vision_config", "vision_tower", "visual", "mm_vision_tower")
_CONTEXT_KEYS = ("max_position_embeddings", "max_seq_len", "seq_length", "n_positions")


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What requests a served model can answer; ``None`` = unknown (see the module doc)."""

    chat: bool | None = None
    tools: bool | None = None
    vision: bool | None = None
    embeddings: bool | None = None
    json_schema: bool | None = None
    context_length: int | None = None
    embedding_dimensions: int | None = None

    @property
    def known(self) -> bool:
        return self != UNKNOWN

    def to_wire(self) -> dict[str, bool | int | None]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, data: object) -> Capabilities:
        """Tolerant: a missing or malformed field reads as unknown."""
        if not isinstance(data, Mapping):
            return UNKNOWN

        def flag(name: str) -> bool | None:
            value = data.get(name)
            return value if isinstance(value, bool) else None

        def size(name: str) -> int | None:
            value = data.get(name)
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        return cls(
            chat=flag("chat"),
            tools=flag("tools"),
            vision=flag("vision"),
            embeddings=flag("embeddings"),
            json_schema=flag("json_schema"),
            context_length=size("context_length"),
            embedding_dimensions=size("embedding_dimensions"),
        )


UNKNOWN = Capabilities()


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What a model's own files say; ``None`` = they do not say."""

    architecture: str = ""
    templates: tuple[str, ...] = ()  # every chat template the model ships
    context_length: int | None = None
    embedding_length: int | None = None
    encoder: bool | None = None  # serves embeddings only (no generative head)
    vision: bool | None = None  # has a vision tower (HF); GGUF projectors are separate files

    @property
    def template_tools(self) -> bool:
        return any("tools" in t for t in self.templates)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def facts_from_gguf(meta: Mapping[str, Any]) -> ModelFacts:
    """From GGUF header key/values (``models.estimate.read_gguf_meta``)."""
    arch = str(meta.get("general.architecture", ""))
    templates = tuple(
        str(v)
        for k, v in sorted(meta.items())
        if (k == "tokenizer.chat_template" or k.startswith("tokenizer.chat_template."))
        and isinstance(v, str)
    )
    return ModelFacts(
        architecture=arch,
        templates=templates,
        context_length=_int(meta.get(f"{arch}.context_length")),
        embedding_length=_int(meta.get(f"{arch}.embedding_length")),
        encoder=arch in ENCODER_GGUF_ARCHS if arch else None,
    )


def _hf_templates(tokenizer_config: Mapping[str, Any], extra: Sequence[str]) -> tuple[str, ...]:
    raw = tokenizer_config.get("chat_template")
    found: list[str] = list(extra)
    if isinstance(raw, str):
        found.append(raw)
    elif isinstance(raw, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use"...}]
        found += [str(t["template"]) for t in raw if isinstance(t, dict) and "template" in t]
    return tuple(found)


def facts_from_hf(
    config: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any] | None = None,
    extra_templates: Sequence[str] = (),
) -> ModelFacts:
    """From a Hugging Face directory: config.json, tokenizer_config.json and a separate
    ``chat_template.jinja`` (``extra_templates``). A vision model's text settings may sit
    in ``text_config``."""
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else {}
    archs = config.get("architectures")
    arch = str(archs[0]) if isinstance(archs, list) and archs else ""
    encoder: bool | None = None
    if arch.endswith(_GENERATIVE):
        encoder = False
    elif arch.endswith(_POOLING):
        encoder = True
    context = next(
        (v for key in _CONTEXT_KEYS for src in (config, text) if (v := _int(src.get(key)))), None
    )
    hidden = _int(config.get("hidden_size")) or _int(text.get("hidden_size"))
    return ModelFacts(
        architecture=arch,
        templates=_hf_templates(tokenizer_config or {}, extra_templates),
        context_length=context,
        embedding_length=hidden or _int(config.get("d_model")),
        encoder=encoder,
        vision=any(key in config for key in _VISION_KEYS),
    )


# --- reading the final argument list ------------------------------------------------------


def _name(arg: str) -> str:
    """A flag's name as the engines read it: ``--a_b=x`` -> ``--a-b``."""
    if not arg.startswith("--"):
        return arg
    return arg.partition("=")[0].replace("_", "-")


def _last(args: Sequence[str], names: frozenset[str]) -> tuple[str, str | None] | None:
    """The last occurrence of any of ``names``: (name, its value or None)."""
    found: tuple[str, str | None] | None = None
    for i, arg in enumerate(args):
        name = _name(arg)
        if name in names:
            if "=" in arg and arg.startswith("--"):
                value: str | None = arg.partition("=")[2]
            else:
                value = args[i + 1] if i + 1 < len(args) else None
            found = (name, value)
    return found


def _has(args: Sequence[str], *names: str) -> bool:
    return _last(args, frozenset(names)) is not None


def _value(args: Sequence[str], *names: str) -> str | None:
    found = _last(args, frozenset(names))
    return found[1] if found else None


def _context(engine: str, args: Sequence[str], model: ModelFacts | None) -> int | None:
    trained = model.context_length if model else None
    set_by_args = engine_context(engine, args)
    if set_by_args is not None and set_by_args.tokens is not None:
        tokens: int | None = set_by_args.tokens
    elif set_by_args is None and engine == "llamacpp" and LLAMACPP_LAUNCHER in args:
        tokens = LAUNCHER_DEFAULT_CTX
    else:
        tokens = None  # the model's own length
    if tokens is not None and trained is not None and engine == "llamacpp":
        return min(tokens, trained)
    return tokens if tokens is not None else trained


def _not(value: bool | None) -> bool | None:
    return None if value is None else not value


def _if_chat(chat: bool | None, value: bool | None) -> bool | None:
    """A chat-only capability: absent on a model that does not chat."""
    return False if chat is False else value


def _llamacpp(args: Sequence[str], model: ModelFacts | None) -> Capabilities:
    chat = _not(model.encoder) if model else None
    embeddings = _has(args, "--embedding", "--embeddings") and _value(args, "--pooling") != "none"
    jinja = _last(args, frozenset({"--jinja", "--no-jinja"}))
    template = _value(args, "--chat-template")
    tools: bool | None
    if jinja is not None and jinja[0] == "--no-jinja":
        tools = False
    elif _has(args, "--chat-template-file"):
        tools = None  # a file on the node
    elif template is not None:
        tools = "tools" in template if "{" in template else None  # text, or a built-in name
    else:
        tools = model.template_tools if model else None
    return Capabilities(
        chat=chat,
        tools=_if_chat(chat, tools),
        vision=_if_chat(chat, _has(args, "-mm", "--mmproj", "-mmu", "--mmproj-url")),
        embeddings=embeddings,
        json_schema=_if_chat(chat, True),
        context_length=_context("llamacpp", args, model),
        embedding_dimensions=model.embedding_length if model and embeddings else None,
    )


_VLLM_POOLING_TASKS = frozenset({"embed", "embedding", "classify", "score", "reward"})


def _pooling(engine: str, args: Sequence[str], model: ModelFacts | None) -> bool | None:
    if engine == "sglang":
        if _has(args, "--is-embedding"):
            return True
    else:
        runner, task = _value(args, "--runner"), _value(args, "--task")
        convert = _value(args, "--convert")
        if runner == "pooling" or task in _VLLM_POOLING_TASKS or convert in ("embed", "classify"):
            return True
        if runner == "generate" or task == "generate":
            return False
    return model.encoder if model else None


def _served(engine: str, args: Sequence[str], model: ModelFacts | None) -> Capabilities:
    pooling = _pooling(engine, args, model)
    chat = _not(pooling)
    if engine == "sglang":
        tools = _has(args, "--tool-call-parser")
    else:
        tools = _has(args, "--enable-auto-tool-choice") and _has(args, "--tool-call-parser")
    return Capabilities(
        chat=chat,
        tools=_if_chat(chat, tools),
        vision=_if_chat(chat, model.vision if model else None),
        embeddings=pooling,
        json_schema=_if_chat(chat, True),
        context_length=_context(engine, args, model),
        embedding_dimensions=model.embedding_length if model and pooling is not False else None,
    )


def _fixed(engine: str, args: Sequence[str], model: ModelFacts | None) -> Capabilities:
    return Capabilities(
        chat=True, embeddings=False, context_length=_context(engine, args, model)
    )


def derive(engine: str, args: Sequence[str], model: ModelFacts | None) -> Capabilities:
    """The capabilities of ``engine`` run with ``args`` (the final argument list: what
    ``build_command`` produced with the task's ``engine_args``, or the argv the agent
    launched) on a model whose files say ``model`` (None: unread). Unknown engines (a
    custom command, an external backend) are :data:`UNKNOWN`."""
    if engine == "llamacpp":
        return _llamacpp(args, model)
    if engine in ("vllm", "vllm-mtt", "sglang"):
        return _served(engine, args, model)
    if engine in ("trtllm", "mindie"):
        return _fixed(engine, args, model)
    return UNKNOWN


def _any(values: Sequence[bool | None]) -> bool | None:
    if any(v is True for v in values):
        return True
    return False if values and all(v is False for v in values) else None


def merge(caps: Sequence[Capabilities]) -> Capabilities:
    """What a model name served by several route targets can do: present if any target
    has it, absent only if every one lacks it; sizes the largest, unknown if any is."""
    if len(caps) == 1:
        return caps[0]

    def size(name: str) -> int | None:
        values = [getattr(c, name) for c in caps]
        return None if not values or None in values else max(values)

    return Capabilities(
        chat=_any([c.chat for c in caps]),
        tools=_any([c.tools for c in caps]),
        vision=_any([c.vision for c in caps]),
        embeddings=_any([c.embeddings for c in caps]),
        json_schema=_any([c.json_schema for c in caps]),
        context_length=size("context_length"),
        embedding_dimensions=size("embedding_dimensions"),
    )
