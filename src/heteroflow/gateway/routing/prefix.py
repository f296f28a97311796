"""Prompt-prefix keys of an inference request (M15 ``prefix_affinity``): pure, no I/O.

A request's prompt is serialised the way a chat template lays it out — the leading
system/developer messages, then the tool definitions (chat templates render tools inside
or right after the system turn), then the other messages in order — stably (JSON parts
with sorted keys), and cut into blocks of ``BLOCK_BYTES`` bytes of UTF-8. Block ``i``'s key
is a 64-bit BLAKE2b hash of block ``i`` chained onto key ``i-1``, so a key names the whole
prefix up to the end of its block (as vLLM's block hashes do): two requests share key ``i``
exactly when their first ``i+1`` blocks are equal. Only full blocks are keyed (a prompt
shorter than one block has no keys), and at most ``MAX_BLOCKS`` (64 KB, ~16k tokens).

Bytes, not tokens: the gateway has no tokenizer for most models, and one is not needed —
an engine's prefix cache hits when the token prefix matches, which is when the text prefix
matches; byte blocks only set how finely a shared prefix is resolved (512 bytes is about
128 tokens of English, 8 of vLLM's 16-token blocks). The hash is stable across processes
and machines (BLAKE2b, not Python's salted ``hash``), so several gateways compute the
same keys for the same request.

Cost: about 2 µs per KB of prompt on one core (a 4,000-token prompt in ~35 µs, measured
in ``tests/unit/test_prefix_keys.py``), on the gateway's hot path only for routes whose
algorithm is ``prefix_affinity``.

Formats: chat (``messages``, ``tools``), completions (``prompt``: a string, a list of
strings, token ids) and responses (``instructions``, ``input``: a string or items). Any
other shape (or an embeddings body's ``input``, which is keyed as responses' is) gives keys
only for what it can read; nothing here raises on a client's body.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from hashlib import blake2b
from typing import Any

import orjson

BLOCK_BYTES = 512
MAX_BLOCKS = 128

_LEADING_ROLES = frozenset({"system", "developer"})
_MSG = b"\x1e"  # separators no UTF-8 text of a prompt confuses with a boundary of ours
_FIELD = b"\x1f"


def prefix_keys(
    body: Mapping[str, Any], *, block_bytes: int = BLOCK_BYTES, max_blocks: int = MAX_BLOCKS
) -> tuple[int, ...]:
    """The chained keys of ``body``'s prompt blocks, shortest prefix first."""
    data = serialise(body, limit=block_bytes * max_blocks)
    n = min(len(data) // block_bytes, max_blocks)
    keys: list[int] = []
    prev = b""
    view = memoryview(data)
    for i in range(n):
        h = blake2b(prev, digest_size=8)
        h.update(view[i * block_bytes : (i + 1) * block_bytes])
        prev = h.digest()
        keys.append(int.from_bytes(prev, "little"))
    return tuple(keys)


def serialise(body: Mapping[str, Any], *, limit: int | None = None) -> bytes:
    """The prompt of ``body`` as bytes in chat-template order (at least ``limit`` bytes
    of it when it is longer: the rest is never keyed, so it is not built)."""
    parts: list[bytes] = []
    size = 0
    for part in _parts(body):
        parts.append(part)
        size += len(part)
        if limit is not None and size >= limit:
            break
    return b"".join(parts)


def _parts(body: Mapping[str, Any]) -> Any:
    messages = body.get("messages")
    if isinstance(messages, list):
        i = 0
        while i < len(messages) and _role(messages[i]) in _LEADING_ROLES:
            yield _message(messages[i])
            i += 1
        tools = body.get("tools")
        if tools:
            yield b"\x1dtools" + _FIELD + _json(tools)
        for m in messages[i:]:
            yield _message(m)
        return
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        yield _MSG + b"system" + _FIELD + instructions.encode()
    tools = body.get("tools")
    if tools:
        yield b"\x1dtools" + _FIELD + _json(tools)
    for name in ("prompt", "input"):
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, str):
            yield _MSG + value.encode()
        elif isinstance(value, list):
            for item in value:
                yield _MSG + (item.encode() if isinstance(item, str) else _content(item))
        return


def _role(m: object) -> object:
    return m.get("role") if isinstance(m, dict) else None


def _message(m: object) -> bytes:
    if not isinstance(m, dict):
        return _MSG + _json(m)
    role = m.get("role")
    out = _MSG + (role.encode() if isinstance(role, str) else b"") + _FIELD
    content = m.get("content")
    if content is not None:
        out += _content(content)
    for extra in ("name", "tool_calls", "tool_call_id"):
        value = m.get(extra)
        if value is not None:
            out += _FIELD + extra.encode() + _FIELD + _content(value)
    return out


def _content(content: object) -> bytes:
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, list):  # parts: text as text, anything else (images) as JSON
        return b"".join(
            p["text"].encode()
            if isinstance(p, dict) and isinstance(p.get("text"), str)
            else _json(p)
            for p in content
        )
    return _json(content)


def _json(value: object) -> bytes:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # not JSON-shaped (a body from an embedder, never the wire's)
        return repr(value).encode()


# -- the view: which replica served which prefix recently ------------------------------

DEFAULT_MAX_ENTRIES = 50_000
DEFAULT_TTL_S = 300.0
MAX_HOLDERS = 4  # replicas remembered per key (a hot prefix spreads over several)


class PrefixView:
    """Which backends served which prefix keys recently, per route: an LRU map with a
    hard cap of ``max_entries`` keys over all routes (under 300 bytes each on CPython
    3.11: 240 measured with one holder, 8 more per extra holder; 50,000 entries ≈ 14 MB),
    each forgotten ``ttl_s`` after it was last served (an engine's cache evicts too; a
    stale guess only costs a prefill). The clock
    is injected (``time.monotonic`` in the gateway, a fake one in tests).

    A key's holders are its last ``MAX_HOLDERS`` distinct base URLs, most recent last.
    Routes share the map under a process-local slot ``hash((route_id, key))``: a 64-bit
    collision between routes only misplaces one guess.

    ``held(url)``: how many live entries name ``url`` as a holder — the blocks of prompt
    this view believes the backend's cache holds, over every route (a replica's cache is
    the replica's, whichever route sent the prompt). New prefixes are placed by it
    (``Balancer``): like SGLang's router sending a prefix no worker holds to the worker
    with the smallest tree, it keeps one replica from being given more prefixes than its
    cache keeps while another's sits empty. Kept exact on every change of an entry's
    holders, eviction and expiry included."""

    __slots__ = ("_clock", "_held", "_map", "_max", "_ttl")

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        self._clock = clock
        self._max = max_entries
        self._ttl = ttl_s
        # slot -> (last served at, holder, ...): one flat tuple per entry saves memory
        self._map: OrderedDict[int, tuple[float | str, ...]] = OrderedDict()
        self._held: dict[str, int] = {}  # base URL -> live entries naming it

    def __len__(self) -> int:
        return len(self._map)

    def held(self, base_url: str) -> int:
        """Live entries naming ``base_url`` (blocks of prompt it is believed to hold)."""
        return self._held.get(base_url, 0)

    def holders(self, route_id: str, key: int) -> tuple[str, ...]:
        """The base URLs that served the prefix ``key`` on ``route_id`` within the TTL."""
        entry = self._map.get(hash((route_id, key)))
        if entry is None or self._clock() - entry[0] > self._ttl:  # type: ignore[operator]
            return ()
        return entry[1:]  # type: ignore[return-value]

    def record(self, route_id: str, keys: Sequence[int], base_url: str) -> None:
        """``base_url`` now holds every prefix in ``keys``."""
        m = self._map
        held = self._held
        now = self._clock()
        ttl = self._ttl
        for key in keys:
            slot = hash((route_id, key))
            entry = m.get(slot)
            if entry is None:
                m[slot] = (now, base_url)
                held[base_url] = held.get(base_url, 0) + 1
                continue
            m.move_to_end(slot)
            if now - entry[0] > ttl:  # type: ignore[operator]
                self._forget(entry)
                m[slot] = (now, base_url)
                held[base_url] = held.get(base_url, 0) + 1
            elif entry[-1] == base_url:
                m[slot] = (now, *entry[1:])
            else:
                others = tuple(u for u in entry[1:] if u != base_url)
                if len(others) == len(entry) - 1:  # a new holder
                    held[base_url] = held.get(base_url, 0) + 1
                urls = (*others, base_url)
                if len(urls) > MAX_HOLDERS:  # the least recent holders drop out
                    self._forget((now, *urls[:-MAX_HOLDERS]))
                    urls = urls[-MAX_HOLDERS:]
                m[slot] = (now, *urls)
        while len(m) > self._max:
            self._forget(m.popitem(last=False)[1])
        while m:  # the least recently served first: expire from the front
            oldest = next(iter(m.values()))
            if now - oldest[0] <= ttl:  # type: ignore[operator]
                break
            self._forget(m.popitem(last=False)[1])

    def _forget(self, entry: tuple[float | str, ...]) -> None:
        """The holders of ``entry`` no longer hold it."""
        held = self._held
        for url in entry[1:]:
            name = str(url)  # entry[0] is the time, the rest are base URLs
            left = held.get(name, 0) - 1
            if left > 0:
                held[name] = left
            else:
                held.pop(name, None)
