"""A LoRA adapter for the tiny Hermes model whose answer is known in advance (LoRA tests).

``write_tiny_lora(DIR)`` writes a PEFT adapter directory — ``adapter_config.json`` and
``adapter_model.safetensors`` — for the model ``tiny_hf.write_tiny_hf`` writes, in well
under a second, with no hub and no torch (numpy and the safetensors layout by hand, as
``tiny_hf`` does).

One rank-8 LoRA on ``lm_head`` (vLLM wraps it as ``LogitsProcessorWithLoRA``), of which
only the first rank is used: ``A`` reads the one-hot channel of the ``"\\n"`` token and
``B`` writes ``_BOOST`` onto the logit of ``Once``. The base model's bigram table makes
``Hello`` follow the assistant header's ``"\\n"`` (logit ~32 after the final norm); the
adapter adds ~80 to ``Once`` there and nothing anywhere else (no other position carries
the ``"\\n"`` channel in an answer), so the chat reply becomes the story chain the base
model already knows: ``Once upon a time, the model spoke.`` (``EXPECTED_CHAT``). The
base model's answers are unchanged (``tiny_hf.EXPECTED``), so a test tells at once which
of the two answered.

Run ``python -m heteroflow.models.tiny_lora DIR`` to write it from a shell.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import numpy.typing as npt

from heteroflow.models import tiny_hf

__all__ = ["EXPECTED_CHAT", "RANK", "main", "write_tiny_lora"]

RANK = 8  # vLLM's default --max-lora-rank is 16: no flag needed
EXPECTED_CHAT = "Once upon a time, the model spoke."
_BOOST = 10.0  # x the normed "\n" channel (~8): ~80 on "Once" against ~32 on "Hello"


def _config() -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": tiny_hf.TINY_HF_DIR_NAME,
        "r": RANK,
        "lora_alpha": RANK,  # scaling alpha / r = 1
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["lm_head"],
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def _weights() -> dict[str, npt.NDArray[np.float32]]:
    v = tiny_hf._vocab()  # the same vocabulary, by construction
    hidden, vocab = tiny_hf._HIDDEN, tiny_hf._VOCAB
    a = np.zeros((RANK, hidden), np.float32)
    b = np.zeros((vocab, RANK), np.float32)
    a[0, v["\n"]] = 1.0
    b[v["Once"], 0] = _BOOST
    p = "base_model.model.lm_head."
    return {p + "lora_A.weight": a, p + "lora_B.weight": b}


def write_tiny_lora(directory: Path) -> Path:
    """Write the adapter into ``directory`` (created; files replaced atomically)."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {
        "adapter_config.json": json.dumps(_config(), indent=1).encode(),
        "adapter_model.safetensors": tiny_hf._safetensors(_weights()),
    }
    for name, data in files.items():
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # readable by an engine running as another user
        os.replace(tmp, directory / name)
    return directory


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m heteroflow.models.tiny_lora DIR", file=sys.stderr)
        return 2
    print(write_tiny_lora(Path(args[0])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
