"""The fenced code blocks of README.md and docs/*.md, and what the docs test does with each.

Pure: reads markdown, knows nothing of servers. ``tests/e2e/test_docs_run.py`` runs
the plans against a live ``heteroflow up``; the rules are written at its top.

A marker right before a block (blank lines between are fine) says how it is treated::

    <!-- docs-test: skip (the reason: required) -->
    <!-- docs-test: exit 1 -->          every command of the block must exit 1
    <!-- docs-test: status 404 -->      a request block must be answered 404
    <!-- docs-test: schema node-config -->  a JSON document, checked against that schema
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHELL_LANGS = frozenset({"bash", "sh", "shell", "console"})
REQUEST_LINE = re.compile(r"^(GET|POST|PUT|PATCH|DELETE) (/\S*)$")
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
_EXPECT = re.compile(r"→\s*(?P<rest>.*)$")
_QUOTED = re.compile(r'"([^"]+)"')
_EXIT = re.compile(r"\bexit (\d+)\b")


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md first, then docs/*.md by name: the order the blocks run in."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclass(frozen=True, slots=True)
class Marker:
    kind: str  # skip | exit | status | schema
    arg: str  # the reason, the number, the schema's name


@dataclass(frozen=True, slots=True)
class Block:
    path: str  # relative to the repository root
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str  # the content, the fence's indentation removed
    marker: Marker | None
    marker_problem: str = ""  # a marker that could not be read
    # the block before this one in the same file (a ``text`` block's owner)
    previous: Block | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass(frozen=True, slots=True)
class Command:
    """One logical command of a shell block: lines joined on a trailing backslash."""

    line: int  # in the markdown file
    source: str  # as written (comments included; bash ignores them)
    expect: tuple[str, ...] = ()  # the quoted strings of a ``# → "…"`` comment
    exit_code: int | None = None  # ``# → exit N``
    sample: str = ""  # expected output shown with it (a console block, a text block)


@dataclass(slots=True)
class Plan:
    """What the docs test does with one block."""

    block: Block
    kind: str  # shell | python | request | schema | skip | problem
    reason: str = ""  # skip: why; problem: what is wrong with the block
    commands: list[Command] = field(default_factory=list)
    samples: int = 0  # ``text`` blocks checked as this block's output

    @property
    def test_id(self) -> str:
        return f"{self.block.where}-{self.kind}"


def _marker(line: str) -> tuple[Marker | None, str]:
    m = _MARKER.match(line)
    if m is None:
        return None, ""
    body = m.group("body")
    skip = re.fullmatch(r"skip\s*\((.*)\)", body, flags=re.S)
    if skip:
        reason = skip.group(1).strip()
        return (Marker("skip", reason), "") if reason else (None, "a skip needs its reason")
    number = re.fullmatch(r"(exit|status)\s+(\d+)", body)
    if number:
        return Marker(number.group(1), number.group(2)), ""
    schema = re.fullmatch(r"schema\s+([a-z0-9-]+)", body)
    if schema:
        return Marker("schema", schema.group(1)), ""
    return None, (
        f"unknown docs-test marker {body!r} (skip (REASON) | exit N | status N | schema NAME)"
    )


def parse(path: Path, root: Path = ROOT) -> list[Block]:
    lines = path.read_text().splitlines()
    rel = str(path.relative_to(root))
    blocks: list[Block] = []
    previous: Block | None = None
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        lang = m.group("info").strip().split(" ")[0].lower()
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        body = [ln[indent:] if ln[:indent].strip() == "" else ln for ln in lines[i + 1 : j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker, problem = _marker(lines[k]) if k >= 0 else (None, "")
        block = Block(rel, i + 1, lang, "\n".join(body), marker, problem, previous)
        blocks.append(block)
        previous = block
        i = j + 1
    return blocks


def comment_of(line: str) -> str:
    """The shell comment at the end of ``line`` ('' when none): a ``#`` at the start of a
    word, outside quotes."""
    quote = ""
    escaped = False
    for i, ch in enumerate(line):
        if escaped:
            escaped = False
        elif ch == "\\" and quote != "'":
            escaped = True
        elif quote:
            if ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[i + 1 :]
    return ""


def _expectations(comment: str) -> tuple[tuple[str, ...], int | None]:
    m = _EXPECT.search(comment)
    if m is None:
        return (), None
    rest = m.group("rest")
    code = _EXIT.search(rest)
    return tuple(_QUOTED.findall(rest)), int(code.group(1)) if code else None


def shell_commands(block: Block) -> list[Command]:
    """The block's logical commands. In a ``console`` block commands start with ``$ ``
    and the lines after one are its sample output."""
    console = block.lang == "console"
    out: list[Command] = []
    pending: list[str] = []
    start = 0
    sample: list[str] = []

    def flush_sample() -> None:
        if out and sample:
            last = out[-1]
            out[-1] = Command(
                last.line, last.source, last.expect, last.exit_code, "\n".join(sample)
            )
        sample.clear()

    for n, raw in enumerate(block.text.splitlines()):
        line = raw.rstrip()
        if not pending:
            if console:
                if not line.startswith("$ "):
                    if line.strip():
                        sample.append(line)
                    continue
                flush_sample()
                line = line[2:]
            stripped = line.strip()
            if not stripped or stripped.startswith("#"):
                continue
            start = block.line + 1 + n
        pending.append(line)
        if line.endswith("\\"):
            continue
        source = "\n".join(pending)
        expect, code = _expectations(comment_of(pending[-1]))
        out.append(Command(start, source, expect, code))
        pending = []
    if pending:  # a trailing backslash: run what there is, bash will say what is wrong
        out.append(Command(start, "\n".join(pending)))
    flush_sample()
    return out


def sample_words(sample: str) -> list[str]:
    """The words of a sample output that must appear in the real one: not those holding
    a digit (ids, ports, counts, times), an ellipsis, or no letter at all."""
    return [w for w in sample.split() if not re.search(r"[0-9…]", w) and re.search(r"[A-Za-z]", w)]


def _request_problem(block: Block) -> str:
    first = block.text.strip().splitlines()[0] if block.text.strip() else ""
    if REQUEST_LINE.match(first.strip()):
        return ""
    return f"a request block starts with METHOD /path; this one starts {first[:60]!r}"


def plan(blocks: list[Block]) -> list[Plan]:
    """One plan per block, ``text`` samples folded into the block they follow."""
    plans: list[Plan] = []
    by_block: dict[int, Plan] = {}
    for b in blocks:
        p = _plan_one(b, by_block)
        if p is not None:
            plans.append(p)
            by_block[id(b)] = p
    return plans


def _plan_one(b: Block, by_block: dict[int, Plan]) -> Plan | None:
    if b.marker_problem:
        return Plan(b, "problem", b.marker_problem)
    m = b.marker
    if m is not None and m.kind == "skip":
        return Plan(b, "skip", m.arg)
    if b.lang in SHELL_LANGS:
        commands = shell_commands(b)
        if m is not None and m.kind == "exit":
            commands = [
                c
                if c.exit_code is not None
                else Command(c.line, c.source, c.expect, int(m.arg), c.sample)
                for c in commands
            ]
        elif m is not None:
            return Plan(b, "problem", f"a {m.kind} marker does not apply to a shell block")
        if not commands:
            return Plan(b, "problem", "a shell block without a command")
        return Plan(b, "shell", commands=commands)
    if b.lang in ("text", "output"):
        owner = by_block.get(id(b.previous)) if b.previous is not None else None
        if owner is None or owner.kind != "shell" or m is not None:
            return Plan(
                b,
                "problem",
                "a text block is the sample output of the shell block right before it "
                "(nothing but prose between); else mark it skip with a reason",
            )
        last = owner.commands[-1]
        sample = f"{last.sample}\n{b.text}".strip()
        owner.commands[-1] = Command(last.line, last.source, last.expect, last.exit_code, sample)
        owner.samples += 1
        return None
    if b.lang == "python":
        if m is not None:
            return Plan(b, "problem", f"a {m.kind} marker does not apply to a python block")
        return Plan(b, "python")
    if b.lang == "http" or (b.lang == "json" and (m is None or m.kind == "status")):
        problem = _request_problem(b)
        if problem:
            if b.lang == "json":
                problem = (
                    "a JSON block is a request (its first line METHOD /path) or a document "
                    "with a `<!-- docs-test: schema NAME -->` marker"
                )
            return Plan(b, "problem", problem)
        if m is not None and m.kind != "status":
            return Plan(b, "problem", f"a {m.kind} marker does not apply to a request")
        return Plan(b, "request")
    if b.lang == "json" and m is not None and m.kind == "schema":
        return Plan(b, "schema", m.arg)
    what = f"language {b.lang!r}" if b.lang else "no language"
    return Plan(
        b,
        "problem",
        f"a block with {what} is neither run nor checked: give it bash/sh/console, python, "
        "json, http or text, or put `<!-- docs-test: skip (REASON) -->` right before it",
    )


def all_plans(root: Path = ROOT) -> list[Plan]:
    return [p for path in doc_files(root) for p in plan(parse(path, root))]


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: str  # "" when none


def request_of(text: str) -> Request:
    """``METHOD /path``, then ``Name: value`` header lines, then (after an optional blank
    line) the JSON body."""
    lines = text.strip().splitlines()
    m = REQUEST_LINE.match(lines[0].strip())
    assert m is not None, lines[0]
    headers: dict[str, str] = {}
    rest = lines[1:]
    while rest and re.match(r"^[A-Za-z0-9-]+: ", rest[0]):
        name, value = rest.pop(0).split(": ", 1)
        headers[name] = value.strip()
    return Request(m.group(1), m.group(2), headers, "\n".join(rest).strip())
