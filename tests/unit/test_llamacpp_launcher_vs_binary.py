"""The launcher's flag spellings against a real ``llama-server --help``.

``tests/data/llama-server-help.txt`` is the ``--help`` output of a stock ``llama-server`` built
once from the llama.cpp tree vendored in the llama-cpp-python sdist (versions and build recipe in
``llama-server-help.meta.json``), so this test needs no binary. Every spelling the launcher
accepts must be one the real server accepts, with the same switch/value shape, so a command line
built for the launcher also starts a stock ``llama-server``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from heteroflow.engines.llamacpp_server import _HELP, _OPTIONS, _Option

pytestmark = pytest.mark.feature("H4")

DATA = Path(__file__).resolve().parents[1] / "data"
HELP_FILE = DATA / "llama-server-help.txt"
META_FILE = DATA / "llama-server-help.meta.json"

# llama.cpp's common_arg::to_string(): an option line starts in column 0 with its comma-separated
# spellings (the first padded to 7 columns), then an optional value hint, then either padding
# of 3+ spaces and the help text, or the end of the line (the help follows on lines indented by
# 40 spaces). Section headers ("----- common params -----") do not match.
_OPTION_LINE = re.compile(
    r"(?P<spellings>--?\w[\w.-]*(?:,\s+--?\w[\w.-]*)*)(?: (?P<hint>\S.*?))?(?:\s{3,}|$)"
)
_SECTION = re.compile(r"----- [\w -]+ -----")

# Launcher spellings a stock llama-server lacks or shapes differently: {spelling: reason}.
# Each makes its option's case a strict xfail; empty means full agreement.
KNOWN_MISMATCHES: dict[str, str] = {}


@dataclass(frozen=True)
class RealOption:
    line: int
    spellings: tuple[str, ...]
    hint: str | None  # None: a switch


@cache
def real_options() -> dict[str, RealOption]:
    """Every spelling in the captured help, mapped to the option line that lists it."""
    by_spelling: dict[str, RealOption] = {}
    for number, line in enumerate(HELP_FILE.read_text().splitlines(), start=1):
        match = _OPTION_LINE.match(line)
        if match is None:
            continue
        spellings = tuple(re.split(r",\s+", match["spellings"]))
        option = RealOption(number, spellings, match["hint"])
        for spelling in spellings:
            assert spelling not in by_spelling, f"{spelling} listed twice in {HELP_FILE.name}"
            by_spelling[spelling] = option
    return by_spelling


def test_capture_is_a_full_llama_server_help() -> None:
    meta = json.loads(META_FILE.read_text())
    assert {"llama_cpp_python", "llama_server_version", "captured", "how"} <= meta.keys()
    # the parser understands every line that is not a help continuation
    unparsed = [
        line
        for line in HELP_FILE.read_text().splitlines()
        if line[:1] not in ("", " ") and not (_OPTION_LINE.match(line) or _SECTION.fullmatch(line))
    ]
    assert not unparsed
    options = real_options()
    assert len(set(options.values())) > 200  # this capture documents 255 options
    assert options["--model"] == RealOption(options["--model"].line, ("-m", "--model"), "FNAME")
    assert "\x1b" not in HELP_FILE.read_text()  # ANSI colours stripped


def test_help_spellings_exist_in_real_server() -> None:
    options = real_options()
    assert all(spelling in options for spelling in _HELP)
    assert options["-h"].hint is None


def _cases() -> list[object]:
    cases: list[object] = []
    for option in _OPTIONS:
        reasons = [KNOWN_MISMATCHES[s] for s in option.spellings if s in KNOWN_MISMATCHES]
        marks = [pytest.mark.xfail(strict=True, reason="; ".join(reasons))] if reasons else []
        cases.append(pytest.param(option, id=option.spellings[0], marks=marks))
    return cases


@pytest.mark.parametrize("option", _cases())
def test_launcher_option_matches_real_server(option: _Option) -> None:
    options = real_options()
    spellings = [s for s in option.spellings if s not in _HELP]
    missing = [s for s in spellings if s not in options]
    assert not missing, f"real llama-server has no {missing}"
    # all spellings of one launcher option name the same real option
    real = {options[s] for s in spellings}
    assert len(real) == 1, f"{spellings} split over real options {sorted(r.line for r in real)}"
    (found,) = real
    if option.convert is None:
        assert found.hint is None, f"{spellings[0]} is a switch here, takes {found.hint} there"
    else:
        assert found.hint is not None, f"{spellings[0]} takes a value here, is a switch there"
        # usage() claims llama-server's notation
        assert option.metavar == found.hint, f"{spellings[0]} {option.metavar} vs {found.hint}"
