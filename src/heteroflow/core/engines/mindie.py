"""MindIE (Ascend) launch: a generated ``config.json`` plus the daemon start, no CLI flags.

MindIE Service reads every setting from ``config.json``; ``MIES_CONFIG_JSON_PATH`` points
it at ours, so the image's own file is left alone. Keys and defaults follow the service
configuration reference (mirror: github.com/verylucky01/MindIE-LLM, docs/zh/user_guide/
user_manual/service_parameter_configuration.md) and its quick start:

* one IP and one port for the service, management and metrics interfaces (a documented
  "单IP地址单端口号" layout), so the readiness probe ``/v2/health/ready`` answers on the
  service port; binding 0.0.0.0 requires ``allowAllZeroIpListening: true``;
* ``npuDeviceIds`` count from 0 because the agent sets ``ASCEND_RT_VISIBLE_DEVICES`` to the
  task's cards, and logical IDs follow that list; ``worldSize`` equals the card count;
* ``npuMemSize: -1`` lets MindIE size the KV cache from ``NPU_MEMORY_FRACTION`` (default
  0.8), which is where ``gpu_memory_utilization`` goes;
* the service checks the config file is mode 640; the agent writes files with its own mode,
  so ``MINDIE_CHECK_INPUTFILES_PERMISSION=0`` turns that check off for our generated file.

The start script sources the Ascend environment scripts that exist in the image, runs from
a writable directory (operators write ``kernel_meta`` there), and starts
``mindie_llm_server`` (MindIE >= 2.2 pip layout) or else the older
``$MIES_INSTALL_PATH/bin/mindieservice_daemon``. There is no pipeline shape (G2).
"""

from __future__ import annotations

import json
import re
from typing import Any

CONFIG_PATH = "/heteroflow/mindie/config.json"
MAX_SEQ_LEN = 2560  # ModelDeployConfig.maxSeqLen: the context every MindIE task runs with
_MODEL_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,254}[A-Za-z0-9])?")

START_SCRIPT = (
    "for f in /usr/local/Ascend/ascend-toolkit/set_env.sh /usr/local/Ascend/cann/set_env.sh "
    "/usr/local/Ascend/nnal/atb/set_env.sh /usr/local/Ascend/atb-models/set_env.sh "
    '/usr/local/Ascend/mindie/set_env.sh; do [ -f "$f" ] && . "$f"; done; '
    "mkdir -p /tmp/mindie && cd /tmp/mindie && "
    "if command -v mindie_llm_server >/dev/null 2>&1; then exec mindie_llm_server; "
    'else exec "${MIES_INSTALL_PATH:-/usr/local/Ascend/mindie/latest/mindie-service}'
    '/bin/mindieservice_daemon"; fi'
)


def valid_model_name(name: str) -> bool:
    """MindIE's rule for ``modelName``: letters, digits, '-', '.', '_', alphanumeric ends."""
    return _MODEL_NAME.fullmatch(name) is not None


def config(*, host: str, port: int, model_name: str, model_path: str, cards: int) -> str:
    """The ``config.json`` text for one model instance on ``cards`` NPUs."""
    server = {
        "ipAddress": host,
        "managementIpAddress": host,
        "port": port,
        "managementPort": port,
        "metricsPort": port,
        "allowAllZeroIpListening": host in ("0.0.0.0", "::"),
        "maxLinkNum": 1000,
        "httpsEnabled": False,
        "fullTextEnabled": False,
        "inferMode": "standard",
        "interCommTLSEnabled": False,
        "openAiSupport": "vllm",
        "tokenTimeout": 600,
        "e2eTimeout": 600,
    }
    model: dict[str, Any] = {
        "modelInstanceType": "Standard",
        "modelName": model_name,
        "modelWeightPath": model_path,
        "worldSize": cards,
        "cpuMemSize": 5,
        "npuMemSize": -1,
        "backendType": "atb",
        "trustRemoteCode": False,
    }
    schedule = {
        "templateType": "Standard",
        "templateName": "Standard_LLM",
        "cacheBlockSize": 128,
        "maxPrefillBatchSize": 50,
        "maxPrefillTokens": 8192,
        "prefillTimeMsPerReq": 150,
        "prefillPolicyType": 0,
        "decodeTimeMsPerReq": 50,
        "decodePolicyType": 0,
        "maxBatchSize": 200,
        "maxIterTimes": 512,
        "maxPreemptCount": 0,
        "supportSelectBatch": False,
        "maxQueueDelayMicroseconds": 5000,
    }
    backend = {
        "backendName": "mindieservice_llm_engine",
        "modelInstanceNumber": 1,
        "npuDeviceIds": [list(range(cards))],
        "tokenizerProcessNumber": 8,
        "multiNodesInferEnabled": False,
        "interNodeTLSEnabled": False,
        "ModelDeployConfig": {
            "maxSeqLen": MAX_SEQ_LEN,
            "maxInputTokenLen": 2048,
            "truncation": False,
            "ModelConfig": [model],
        },
        "ScheduleConfig": schedule,
    }
    document = {"Version": "1.0.0", "ServerConfig": server, "BackendConfig": backend}
    return json.dumps(document, indent=2, ensure_ascii=False) + "\n"


def env(memory_fraction: str) -> dict[str, str]:
    return {
        "MIES_CONFIG_JSON_PATH": CONFIG_PATH,
        "MINDIE_CHECK_INPUTFILES_PERMISSION": "0",
        "MINDIE_LOG_TO_STDOUT": "1",
        "NPU_MEMORY_FRACTION": memory_fraction,
    }
