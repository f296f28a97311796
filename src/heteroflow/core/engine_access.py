"""Who may call an engine, and with what (FEATURES C14): pure rules, no I/O.

Every engine replica has a secret of its own, the *engine key*, derived by the server
from one platform secret and the task's id (``engine_key``): a new task — a rebuild
elsewhere, a rolling update's replica — has a new key, and no key is stored anywhere.
The agent gives it to the engine (an environment variable where the engine reads one:
``KEY_ENV``; never on the command line, which every user of a host can read) and the
server gives it to the gateways in the routing snapshot (``Backend.auth``), which send
it on every upstream request, probe and scrape.

Engines listen only on the node's private loopback address (``ENGINE_ADDRESS``, a
127/8 address no other host can reach); the only way in from the network is the node
agent's *door* (``agent.engine_door``) on the task's booked port at the node's address.
The door lets a request through only when it carries the engine's key and asks for a
route of the OpenAI surface or the two reads a gateway needs (``door_admits``): health
and metrics. Everything else an engine serves — vLLM's ``/sleep``, ``/wake_up``,
``/collective_rpc``, ``/reset_prefix_cache``, LoRA loading, llama.cpp's ``/slots`` and
``/props`` — is answered by the door with 404 and reached only by the agent itself over
the node's loopback. The door is the guard for every engine, whatever its own key
covers (vLLM's key guards ``/v1`` only; SGLang, TensorRT-LLM and MindIE are given none).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from heteroflow.core.gang import serves_api

__all__ = [
    "DOOR_PATHS",
    "DOOR_PREFIXES",
    "ENGINE_ADDRESS",
    "ENGINE_KEY_SECRET",
    "KEY_ENV",
    "KEY_PREFIX",
    "PLATFORM_ONLY",
    "bearer_matches",
    "door_admits",
    "door_port",
    "engine_key",
    "key_env",
]

# The node's private address for engines: loopback (Linux routes all of 127/8 to lo),
# but not 127.0.0.1, which is the node's own address on a single machine and where the
# door listens there. Packets to 127/8 never leave a host and are dropped when they come
# from outside, so only the node's own processes reach an engine directly.
ENGINE_ADDRESS = "127.0.0.2"

KEY_PREFIX = "hfe-"  # an engine key in a log line or a leak is recognisable
# the platform_settings row of the secret every engine key derives from
ENGINE_KEY_SECRET = "engine_key_secret"  # noqa: S105 - a row's name, not a secret

# engine -> the variable its server reads its API key from (none: the door guards alone).
# vLLM: VLLM_API_KEY (vllm.envs; its key guards the /v1 routes). llama-server:
# LLAMA_API_KEY (its --api-key's env; guards every route but /health and /models; the
# process runtime's launcher reads the same variable). SGLang (--api-key only),
# TensorRT-LLM (trtllm-serve has no key) and MindIE (its key is a TLS client
# certificate, not a bearer token) take no key but on the command line or not at all.
KEY_ENV: Mapping[str, str] = {
    "vllm": "VLLM_API_KEY",
    "vllm-mtt": "VLLM_API_KEY",
    "llamacpp": "LLAMA_API_KEY",
}

# What a gateway (or anyone holding the key) may ask an engine through the door.
DOOR_PATHS = frozenset({"/health", "/metrics"})
DOOR_PREFIXES = ("/v1/",)
# Under /v1 but the platform's business only: the agent loads adapters (vLLM's runtime
# LoRA routes) and nothing from the network may.
PLATFORM_ONLY = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def door_port(
    task_type: str, parallelism: str, api_host_port: int, rank: int = 0
) -> int | None:
    """The host port that a door guards for a task, or None: an inference task's API
    port (its first mapping). An inference gang (pipeline) serves its API from rank 0
    only (``core.gang.serves_api``), which listens on the engine address behind its door
    as any engine does; its headless stages serve nothing to guard."""
    if task_type != "inference" or not api_host_port or not serves_api(parallelism, rank):
        return None
    return api_host_port


def engine_key(secret: str, task_id: str) -> str:
    """The engine key of one task: an HMAC of its id under the platform's secret."""
    mac = hmac.new(secret.encode(), b"engine-key:" + task_id.encode(), hashlib.sha256)
    return KEY_PREFIX + mac.hexdigest()


def key_env(engine: str, key: str) -> dict[str, str]:
    """The environment that gives ``engine`` its key ({} when it reads none, or no key)."""
    name = KEY_ENV.get(engine)
    return {name: key} if name and key else {}


def _path_of(target: str) -> str:
    path = target.split("?", 1)[0].split("#", 1)[0]
    return path


def door_admits(path: str) -> bool:
    """Whether a request for ``path`` (the request target, query included) may pass the
    door; a path that is not plain (``..``, ``//``, percent-escapes, no leading slash)
    never does, so an engine's own path handling cannot be steered around the list."""
    p = _path_of(path)
    if not p.startswith("/") or "//" in p or "%" in p or "\\" in p:
        return False
    if any(seg in (".", "..") for seg in p.split("/")):
        return False
    if p in PLATFORM_ONLY:
        return False
    return p in DOOR_PATHS or p.startswith(DOOR_PREFIXES)


def bearer_matches(header: bytes | None, key: str) -> bool:
    """Whether an Authorization header value carries ``key`` as a bearer token
    (compared in constant time)."""
    if not header or not key:
        return False
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    return hmac.compare_digest(token.strip(), key.encode())
