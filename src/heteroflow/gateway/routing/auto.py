"""``model="auto"`` (M10): a rule-based choice among the models a key may call; pure.

Candidates are the key's callable models that have a routable backend (one that is not
draining), minus the name ``auto`` itself. The rules, in order, each narrowing the set:

1. Kind: ``/v1/embeddings`` considers only models tagged ``embedding``; chat and text
   completions never consider them.
2. Capabilities: every tag named in the ``x-heteroflow-capabilities`` header
   (comma-separated, e.g. ``code,vision``) must be on the model's route.
3. Prompt length: a prompt estimated (characters / 4) above ``long_prompt_tokens``
   prefers models tagged ``long-context``; when none is, the rule is skipped (and says
   so) rather than refusing a request that may well fit.
4. Load: the model with the fewest requests in flight through this gateway per usable
   backend; ties go to the first name in sorted order, so the choice is reproducible.

Rules 1 and 2 are requirements: nothing left means a 404 ``model_not_found`` that names
what was asked for. The choice and the rules that made it go back to the client in the
``x-heteroflow-auto-model`` response header, e.g.
``code-llm; reason=capabilities=code; prompt~12 tokens; least loaded 0.0 of 2``.
The upstream receives the chosen model's name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from heteroflow.schemas.routing import RouteTarget

AUTO_MODEL = "auto"
CAPABILITIES_HEADER = b"x-heteroflow-capabilities"
AUTO_HEADER = b"x-heteroflow-auto-model"
LONG_CONTEXT_TAG = "long-context"
EMBEDDING_TAG = "embedding"
DEFAULT_LONG_PROMPT_TOKENS = 4096
CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class AutoChoice:
    model: str
    reason: str

    def header(self) -> tuple[bytes, bytes]:
        value = f"{self.model}; reason={self.reason}"
        return AUTO_HEADER, value.encode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class NoAutoChoice:
    """Nothing fits; ``message`` says which requirement was not met."""

    message: str


def parse_capabilities(raw: bytes | None) -> frozenset[str]:
    if not raw:
        return frozenset()
    text = raw.decode("latin-1")
    return frozenset(c.strip().lower() for c in text.split(",") if c.strip())


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """Characters of the prompt text / 4: ``messages`` (chat), ``prompt``, ``input``."""
    chars = 0
    for key in ("messages", "prompt", "input"):
        chars += _text_chars(body.get(key))
    return chars // CHARS_PER_TOKEN


def _text_chars(value: object) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_text_chars(v) for v in value)
    if isinstance(value, dict):
        # a chat message {"role", "content"} or a content part {"type": "text", "text"}
        return _text_chars(value.get("content")) + _text_chars(value.get("text"))
    return 0


def choose_model(
    routes: Mapping[str, Sequence[RouteTarget]],
    *,
    embeddings: bool,
    capabilities: frozenset[str],
    prompt_tokens: int,
    long_prompt_tokens: int,
    load: Callable[[Sequence[RouteTarget]], float],
) -> AutoChoice | NoAutoChoice:
    """Apply the rules to ``routes`` (callable model name -> its route targets)."""
    tags = {m: _tags(ts) for m, ts in routes.items() if m != AUTO_MODEL and _routable(ts)}
    reasons: list[str] = []
    if embeddings:
        names = sorted(m for m, t in tags.items() if EMBEDDING_TAG in t)
        if not names:
            return NoAutoChoice(f"no model this key may call is tagged {EMBEDDING_TAG!r}")
    else:
        names = sorted(m for m, t in tags.items() if EMBEDDING_TAG not in t)
        if not names:
            return NoAutoChoice("no model this key may call is routable")
    if capabilities:
        names = [m for m in names if capabilities <= tags[m]]
        wanted = ",".join(sorted(capabilities))
        if not names:
            return NoAutoChoice(f"no model this key may call has the capabilities {wanted!r}")
        reasons.append(f"capabilities={wanted}")
    reasons.append(f"prompt~{prompt_tokens} tokens")
    if prompt_tokens > long_prompt_tokens:
        long = [m for m in names if LONG_CONTEXT_TAG in tags[m]]
        if long:
            names = long
            reasons.append(f">{long_prompt_tokens}: {LONG_CONTEXT_TAG}")
        else:
            reasons.append(f">{long_prompt_tokens} but no {LONG_CONTEXT_TAG} model")
    loads = {m: load(routes[m]) for m in names}
    best = min(names, key=lambda m: loads[m])  # first in sorted order on ties
    reasons.append(f"least loaded {loads[best]:.1f} of {len(names)}")
    return AutoChoice(best, "; ".join(reasons))


def _routable(targets: Iterable[RouteTarget]) -> bool:
    return any(not b.draining for t in targets for b in t.backends)


def _tags(targets: Iterable[RouteTarget]) -> frozenset[str]:
    return frozenset(tag.lower() for t in targets for tag in t.tags)
