"""The node's own configuration file (JSON), written by the operator.

```json
{"gpus": [{"index": 0, "vendor": "nvidia", "model": "A10", "memory_mb": 24576}],
 "allowed_volume_prefixes": ["/data/models"],
 "denied_volume_prefixes": ["/data/models/private"],
 "labels": {"zone": "a"},
 "model_scan_dirs": ["/srv/models"],
 "engine_images": {"vllm": "registry.local/vllm/vllm-openai:v0.11.2"}}
```
``gpus`` declares cards openly for hosts where NVML cannot see them (or CPU-only test
nodes); when NVML finds cards, they win. Unknown keys are rejected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heteroflow.agent.inventory import GpuCard, declared_cards

_KEYS = {
    "gpus",
    "allowed_volume_prefixes",
    "denied_volume_prefixes",
    "labels",
    "model_scan_dirs",
    "engine_images",
}


@dataclass(frozen=True, slots=True)
class NodeConfig:
    gpus: tuple[GpuCard, ...] = ()
    allowed_volume_prefixes: tuple[str, ...] = ()
    denied_volume_prefixes: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)
    # None = not configured (HETEROFLOW_MODEL_SCAN_DIRS, then the default cache dir)
    model_scan_dirs: tuple[str, ...] | None = None
    # engine -> the exact image ref the operator runs it from (default: upstream's)
    engine_images: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NodeConfig:
        unknown = set(data) - _KEYS
        if unknown:
            raise ValueError(f"agent config: unknown key(s) {sorted(unknown)}")
        for key in ("allowed_volume_prefixes", "denied_volume_prefixes"):
            for i, p in enumerate(data.get(key, [])):
                if not isinstance(p, str) or not p.startswith("/"):
                    raise ValueError(f"agent config: {key}[{i}] must be an absolute path")
        return cls(
            gpus=tuple(declared_cards(data.get("gpus", []))),
            allowed_volume_prefixes=tuple(
                str(Path(p)) for p in data.get("allowed_volume_prefixes", [])
            ),
            denied_volume_prefixes=tuple(
                str(Path(p)) for p in data.get("denied_volume_prefixes", [])
            ),
            labels={str(k): str(v) for k, v in data.get("labels", {}).items()},
            model_scan_dirs=(
                tuple(str(d) for d in data["model_scan_dirs"])
                if "model_scan_dirs" in data
                else None
            ),
            engine_images={str(k): str(v) for k, v in data.get("engine_images", {}).items()},
        )

    @classmethod
    def load(cls, path: Path | None) -> NodeConfig:
        if path is None:
            return cls()
        return cls.from_dict(json.loads(path.read_text()))
