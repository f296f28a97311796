"""Engine names and the part of engine selection the spine needs.

The full selection chain (vendor priorities, availability probe, templates) arrives with
the engines work; here: an explicit ``task.engine`` or the ``heteroflow.engine`` label
wins, else a keyword in the image name decides (the spec counts both as explicit).
"""

from __future__ import annotations

ENGINES = ("vllm", "sglang", "llamacpp", "trtllm", "mindie", "vllm-mtt")
# Engines that can run without a GPU (gpu_required: 0).
CPU_CAPABLE = frozenset({"llamacpp"})

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
