"""An engine's last words on the first line of its failure (issue 33: "engine exited with
code 1; last output:" and nothing after it in every list, the reason only in the logs)."""

from __future__ import annotations

import pytest

from heteroflow.agent.watch import last_words

LLAMA_EMPTY_GGUF = """\
0.00.006.652 E cmn  common_init_: failed to load model '/m/empty.gguf'
0.00.006.663 E srv    load_model: failed to load model, '/m/empty.gguf'
0.00.006.665 I srv    operator(): operator(): cleaning up before exit...
error: llama.cpp failed to start on /m/empty.gguf: Failed to init server
0.00.006.903 E srv          init: exiting due to model loading error
"""

# measured: a GGUF of an architecture llama.cpp does not know, on the process runtime
LLAMA_UNKNOWN_ARCH = """\
0.00.004.946 I srv    load_model: loading model '/m/weird.gguf'
0.00.005.248 E llama_model_load: error loading model: unknown model architecture: 'nosucharch'
0.00.005.276 E llama_model_load_from_file_impl: failed to load model
0.00.005.402 E cmn  common_init_: failed to load model '/m/weird.gguf'
0.00.005.634 E srv          init: exiting due to model loading error
error: llama.cpp failed to start on /m/weird.gguf: Failed to init server, please check the \
input params.
"""


@pytest.mark.parametrize(
    ("tail", "said"),
    [
        (LLAMA_EMPTY_GGUF, "common_init_: failed to load model '/m/empty.gguf'"),
        (LLAMA_UNKNOWN_ARCH, "error loading model: unknown model architecture: 'nosucharch'"),
        ("llamacpp_server: error: invalid argument: --x\n(see --help)\n",
         "llamacpp_server: error: invalid argument: --x"),
        ("Traceback (most recent call last):\n  File x\nValueError: max_model_len too big\n",
         "ValueError: max_model_len too big"),
        ("0.01 I loading\n0.02 E srv   load_model: CUDA out of memory\nbye\n",
         "load_model: CUDA out of memory"),
        ("starting\nlistening\n", "listening"),
        ("", ""),
    ],
)  # fmt: skip
def test_the_line_that_says_why(tail: str, said: str) -> None:
    assert last_words(tail) == said


def test_a_long_line_is_shortened() -> None:
    assert len(last_words("error: " + "x" * 1000)) == 300
