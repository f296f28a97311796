"""The requests an engine runs at once, read from its arguments as the engine reads them
(M16: a backend's slots, the fair-share bound of its pool)."""

from __future__ import annotations

import pytest

from heteroflow.core.engines import ENGINES
from heteroflow.core.engines.flags import accepted_flags
from heteroflow.core.engines.registry import engine_slots


@pytest.mark.feature("M16")
@pytest.mark.parametrize(
    ("engine", "args", "slots"),
    [
        ("llamacpp", ["-np", "4"], 4),
        ("llamacpp", ["--parallel", "8", "-c", "4096"], 8),
        ("llamacpp", ["-np", "2", "--parallel", "6"], 6),  # the last occurrence wins
        ("llamacpp", ["--parallel=4"], 0),  # llama.cpp's parser takes no --flag=value
        ("llamacpp", ["-np", "-1"], 0),  # auto: the engine decides, unknown here
        ("llamacpp", ["-c", "4096"], 0),  # unset: llama-server's auto, not guessed
        ("vllm", ["--max-num-seqs", "64"], 64),
        ("vllm", ["--max_num_seqs=32"], 32),  # vLLM's parser reads both
        ("vllm", ["--max-num-seqs", "0"], 0),  # refused by the engine: not a bound
        ("vllm", ["--max-num-seqs", "many"], 0),
        ("vllm-mtt", ["--max-num-seqs", "16"], 16),
        ("sglang", ["--max-running-requests=24"], 24),
        ("trtllm", ["--max_batch_size", "8"], 8),
        ("mindie", ["-np", "4"], 0),  # a JSON config, no such flag
        ("my-own-engine", ["-np", "4"], 0),  # a custom command's engine: nothing known
    ],
)
def test_an_engines_slots_are_read_from_its_own_flag(
    engine: str, args: list[str], slots: int
) -> None:
    assert engine_slots(engine, args) == slots


def test_every_slots_flag_is_a_flag_the_engine_accepts() -> None:
    """The spellings are the engines' own (flags.py, transcribed from their CLIs)."""
    named = 0
    for name, spec in ENGINES.items():
        if spec.slots_flag is not None:
            named += 1
            for spelling in spec.slots_flag.spellings:
                assert spelling in accepted_flags(name), (name, spelling)
    assert named == len(ENGINES) - 1  # all but MindIE (a JSON config)
