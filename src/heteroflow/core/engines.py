"""Engine names and the part of engine selection the spine needs.

The full selection chain (vendor priorities, availability probe, templates) arrives with
the engines work; here: an explicit ``task.engine`` or the ``heteroflow.engine`` label
wins, else a keyword in the image name decides (the spec counts both as explicit).
"""

from __future__ import annotations

ENGINES = ("vllm", "sglang", "llamacpp", "trtllm", "mindie", "vllm-mtt")
# Engines that can run without a GPU (gpu_required: 0).
CPU_CAPABLE = frozenset({"llamacpp"})

# llama-server flags the platform sets itself; a task may not override them through
# engine_args (the launcher's last occurrence wins, so an override would bypass the
# model allow-list, the 127.0.0.1 bind and the allocated port).
LLAMACPP_AGENT_FLAGS = frozenset({"-m", "--model", "--host", "--port", "-a", "--alias"})


def owned_flag_in(args: list[str], owned: frozenset[str]) -> str | None:
    """The first argument that sets one of ``owned`` (also as ``--flag=value``)."""
    return next((a for a in args if a in owned or a.split("=", 1)[0] in owned), None)


# Order matters: "vllm-mtt" images contain "vllm"; trtllm before anything generic.
_IMAGE_KEYWORDS: tuple[tuple[str, str], ...] = (
    ("tensorrt-llm", "trtllm"),
    ("trtllm", "trtllm"),
    ("vllm-mtt", "vllm-mtt"),
    ("sglang", "sglang"),
    ("llama.cpp", "llamacpp"),
    ("llamacpp", "llamacpp"),
    ("llama-cpp", "llamacpp"),
    ("mindie", "mindie"),
    ("vllm", "vllm"),
)


def engine_from_image(image: str) -> str:
    """The engine an image name names, or "" when it names none."""
    name = image.lower().split("@", 1)[0]
    for keyword, engine in _IMAGE_KEYWORDS:
        if keyword in name:
            return engine
    return ""


def resolve_engine(explicit: str, label: str, image: str) -> tuple[str, str]:
    """(engine, why) — why is recorded on the task so the choice is explainable."""
    if explicit:
        return explicit, "explicit task.engine"
    if label:
        return label, "label heteroflow.engine"
    by_image = engine_from_image(image)
    if by_image:
        return by_image, f"image name {image!r} names {by_image}"
    return "", "no engine named; left to the node's selection chain"
