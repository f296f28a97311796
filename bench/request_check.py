"""The cost of the gateway's request check (``heteroflow.gateway.shaping.requests.check``).

Times the check on typical bodies (a 3-message chat, a chat with 3 tools, an embeddings
batch of 16; and a batch of 2048, the largest OpenAI takes) against ``orjson.loads`` of
the same body in the same run — the parse the gateway does anyway — so the ratio holds on
any machine. Best of REPEATS rounds (each about as long whatever the body's size), in
microseconds per call. Last line: one JSON object of the figures.

    .venv/bin/python bench/request_check.py
"""

from __future__ import annotations

import functools
import timeit
from typing import Any

import orjson

from heteroflow.gateway.shaping.requests import check

REPEATS = 7
NUMBER = 20_000

_WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {
            "model": "llama-3.1-8b",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"},
                {"role": "assistant", "content": "Paris."},
            ],
            "temperature": 0.7,
            "max_tokens": 128,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    "tools": (
        "/v1/chat/completions",
        {
            "model": "qwen2.5-7b",
            "messages": [
                {"role": "system", "content": "Use the tools when they help."},
                {"role": "user", "content": "Weather in Paris, time in Tokyo, 2+2?"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": f"The {name} tool.",
                        "parameters": _WEATHER_PARAMS,
                    },
                }
                for name in ("get_weather", "get_time", "calculate")
            ],
            "tool_choice": "auto",
            "temperature": 0.2,
        },
    ),
    "embeddings": (
        "/v1/embeddings",
        {
            "model": "bge-small",
            "input": [f"passage number {i}: some text to embed for the index" for i in range(16)],
            "encoding_format": "float",
        },
    ),
    # the largest batch OpenAI takes: how the check scales with a body's size
    "embeddings_2048": (
        "/v1/embeddings",
        {"model": "bge-small", "input": [f"passage {i}: some text to embed" for i in range(2048)]},
    ),
}


def _best_us(stmt: Any, size: int) -> float:
    number = max(20, NUMBER * 200 // size)  # about the same time per body, whatever its size
    return min(timeit.repeat(stmt, number=number, repeat=REPEATS)) / number * 1e6


def main() -> None:
    figures: dict[str, float] = {}
    print(f"{'body':<16}{'check µs':>10}{'loads µs':>10}{'check/loads':>13}")
    for label, (path, body) in BODIES.items():
        raw = orjson.dumps(body)
        parsed = orjson.loads(raw)
        assert check(path, parsed) is None, f"{label} must pass the check"
        size = max(200, len(raw))
        check_us = _best_us(functools.partial(check, path, parsed), size)
        loads_us = _best_us(functools.partial(orjson.loads, raw), size)
        ratio = check_us / loads_us
        print(f"{label:<16}{check_us:>10.2f}{loads_us:>10.2f}{ratio:>13.2f}")
        figures[f"check_us_{label}"] = round(check_us, 3)
        figures[f"loads_us_{label}"] = round(loads_us, 3)
        figures[f"ratio_{label}"] = round(ratio, 2)
    print(orjson.dumps(figures).decode())


if __name__ == "__main__":
    main()
