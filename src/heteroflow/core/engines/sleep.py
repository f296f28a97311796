"""How a task's engine sleeps (F1, F2): kept asleep in its own memory, or stopped.

One decision, made here for the recipe (which flags the engine starts with), the dry run
(which shows them) and the agent (what it does at sleep and wake):

* **kept** — vLLM's own sleep mode (``--enable-sleep-mode`` with
  ``VLLM_SERVER_DEV_MODE=1`` for its ``/sleep``, ``/is_sleeping`` and ``/wake_up``
  routes). At sleep the agent asks for level 1: the weights are copied to the host's
  memory and the KV cache dropped, so the card's memory is free while the engine process
  stays; at wake ``/wake_up`` copies them back — seconds, where a stopped engine reloads
  its model from disk for minutes. Only where vLLM supports it: the upstream engine on
  CUDA cards (vLLM's sleep-mode docs: "Supported on CUDA platform"; ROCm support came
  later and is not proven here), from the release that added the HTTP routes (0.7.3)
  when the image names its version.
* **stopped** — everything else (llama.cpp, SGLang, the CPU build, which refuses
  ``--enable-sleep-mode`` with "not supported on current platform", Moore Threads'
  build, a card vendor vLLM has no sleep mode for): the spec's sleep — ``POST
  /sleep?level=2`` where the engine has it, then the engine is stopped and the container
  kept — and a wake that starts it again and waits for its load (D5).

At sleep time the agent may still stop a kept-mode engine (``keep_fits``): level 1 needs
the host memory to hold the weights, so a node short of memory stops the engine instead
(and says so). A card borrowed by training (F5) gets its sleeping engine stopped before
the borrower starts: the card must really be free.
"""

from __future__ import annotations

from dataclasses import dataclass

from heteroflow.core.engines.kv_offload import parse_version

__all__ = ["KEEP_HEADROOM", "SleepMode", "keep_fits", "sleep_mode"]

#: The first vLLM release whose OpenAI server has the /sleep and /wake_up routes.
FIRST_SLEEP_RELEASE = (0, 7, 3)
#: Host memory kept free beyond the weights a level-1 sleep copies out of the cards.
KEEP_HEADROOM = 1.10


@dataclass(frozen=True)
class SleepMode:
    """``kept``: the engine starts with its sleep mode and stays up while asleep."""

    kept: bool
    reason: str

    def words(self) -> str:
        """What the task's status says when it sleeps this way."""
        if self.kept:
            return (
                "engine kept asleep (vLLM sleep mode level 1: weights in host memory, "
                "the card's memory free); wakes in seconds"
            )
        return f"engine stopped ({self.reason}); a wake loads the model again"


def sleep_mode(
    engine: str, vendor: str, engine_version: str = "", *, parallelism: str = "single"
) -> SleepMode:
    """How ``engine`` on cards of ``vendor`` ("" = no card) sleeps; ``engine_version`` is
    the image's version where known ("" = a current release). A pipeline gang's stages
    are stopped (issue 32): vLLM's sleep mode across a pipeline is not proven, and a gang
    sleeps whole, the same way on every stage."""
    if parallelism == "pipeline":
        return SleepMode(False, "a pipeline gang sleeps by stopping every stage")
    if engine == "vllm-mtt":
        return SleepMode(False, "Moore Threads' vLLM build has no sleep mode")
    if engine != "vllm":
        return SleepMode(False, f"{engine or 'this engine'} has no sleep mode")
    if not vendor:
        return SleepMode(False, "vLLM's CPU build refuses --enable-sleep-mode")
    if vendor != "nvidia":
        return SleepMode(False, f"vLLM's sleep mode is proven on CUDA cards, not {vendor}")
    if engine_version:
        try:
            version = parse_version(engine_version)[:3]
        except ValueError:  # not a version (a tag like "latest"): a current release
            version = FIRST_SLEEP_RELEASE
        if version < FIRST_SLEEP_RELEASE:
            return SleepMode(False, f"vLLM {engine_version} predates the /sleep routes (0.7.3)")
    return SleepMode(True, "vLLM on CUDA cards")


def keep_fits(weights_bytes: int, available_bytes: int) -> bool:
    """Whether a level-1 sleep may copy ``weights_bytes`` into the host's free memory."""
    return weights_bytes * KEEP_HEADROOM <= available_bytes
