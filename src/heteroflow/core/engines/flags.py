"""Accepted command-line flags of each engine at a pinned version, as data with its source.

These lists are transcribed from the engines' own docs/source (stored copies read through
the search tool), never derived from our builder: the tests check every flag
``commands.build_command`` emits against them, so the builder is compared with the engine.
Each list is the serving-relevant part of the CLI actually read at that pin, not
necessarily every flag the engine has.

MindIE takes no flags (it reads a JSON config); ``MINDIE_CONFIG_KEYS`` lists the keys of
its documented ``config.json`` for the same purpose.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AcceptedFlags:
    engine: str
    version: str
    source: str
    flags: frozenset[str]


def _flags(text: str) -> frozenset[str]:
    return frozenset(text.split())


VLLM = AcceptedFlags(
    engine="vllm",
    version="0.11.0 (commit 99d7eb5d)",
    source=(
        "github.com/vllm-project/vllm@99d7eb5d6a512cfcc5a2b104f24ebf2d6cda772b "
        "vllm/engine/arg_utils.py EngineArgs.add_cli_args; FrontendArgs of "
        "vllm/entrypoints/openai/cli_args.py (read @00522333); --headless/--api-server-count "
        "of vllm/entrypoints/cli/serve.py (docs.vllm.ai v0.9.0-v0.12.0 api pages)"
    ),
    flags=_flags(
        """
        --model --runner --convert --task --tokenizer --tokenizer-mode --trust-remote-code
        --dtype --seed --hf-config-path --allowed-local-media-path --revision --code-revision
        --rope-scaling --rope-theta --tokenizer-revision --max-model-len --quantization -q
        --enforce-eager --max-logprobs --logprobs-mode --disable-sliding-window
        --disable-cascade-attn --skip-tokenizer-init --enable-prompt-embeds
        --served-model-name --config-format --hf-token --hf-overrides --pooler-config
        --logits-processor-pattern --generation-config --override-generation-config
        --enable-sleep-mode --model-impl --override-attention-dtype --logits-processors
        --io-processor-plugin --load-format --download-dir --safetensors-load-strategy
        --model-loader-extra-config --ignore-patterns --use-tqdm-on-load
        --pt-load-map-location --reasoning-parser --distributed-executor-backend
        --pipeline-parallel-size -pp --tensor-parallel-size -tp
        --decode-context-parallel-size -dcp --data-parallel-size -dp --data-parallel-rank
        --data-parallel-start-rank --data-parallel-size-local --data-parallel-address
        --data-parallel-rpc-port --data-parallel-backend --data-parallel-hybrid-lb
        --enable-expert-parallel --enable-eplb --max-parallel-loading-workers
        --ray-workers-use-nsight --disable-custom-all-reduce --worker-cls
        --worker-extension-cls --block-size --gpu-memory-utilization --kv-cache-memory-bytes
        --swap-space --kv-cache-dtype --num-gpu-blocks-override --enable-prefix-caching
        --prefix-caching-hash-algo --cpu-offload-gb --calculate-kv-scales
        --max-num-batched-tokens --max-num-seqs --max-num-partial-prefills
        --max-long-partial-prefills --long-prefill-token-threshold --scheduling-policy
        --enable-chunked-prefill --disable-chunked-mm-input --scheduler-cls
        --disable-hybrid-kv-cache-manager --async-scheduling --enable-lora --max-loras
        --max-lora-rank --limit-mm-per-prompt --disable-log-stats
        --host --port --uds --uvicorn-log-level --allow-credentials --allowed-origins
        --allowed-methods --allowed-headers --api-key --ssl-keyfile --ssl-certfile
        --ssl-ca-certs --root-path --middleware --lora-modules --chat-template
        --response-role --enable-auto-tool-choice --tool-call-parser --max-log-len
        --enable-prompt-tokens-details --enable-request-id-headers --disable-fastapi-docs
        --headless --api-server-count --config
        """
    ),
)

# Flags added after 0.11.0 that the builder uses: multi-node MP executor (vllm#23691:
# "--nnodes --node-rank --master-addr [--master-port] [--headless]") and the KV offload CLI
# (RFC vllm#26858), as registered in a later vllm/engine/arg_utils.py ParallelConfig /
# CacheConfig group.
VLLM_LATER = AcceptedFlags(
    engine="vllm",
    version=">= 0.11.1",
    source=(
        "vllm/engine/arg_utils.py add_cli_args after vllm-project/vllm#23691 and #26858: "
        'parallel_group.add_argument("--master-addr"/"--master-port"/"--nnodes", "-n"/'
        '"--node-rank", "-r"); cache_group.add_argument("--kv-offloading-size"/'
        '"--kv-offloading-backend")'
    ),
    flags=_flags(
        "--master-addr --master-port --nnodes -n --node-rank -r "
        "--kv-offloading-size --kv-offloading-backend"
    ),
)

# The MUSA build is upstream vLLM plus the vllm-musa platform plugin: the CLI is vLLM's.
VLLM_MTT = AcceptedFlags(
    engine="vllm-mtt",
    version="0.28.0 (vllm-musa release image)",
    source=(
        "github.com/MooreThreads/vllm-musa docker/README.md (registry.mthreads.com/mcconline/"
        "inference/vllm/vllm-openai:v0.28.0, ENTRYPOINT vllm serve, model positional, "
        '"--host 0.0.0.0"); flags as vLLM upstream above'
    ),
    flags=VLLM.flags | VLLM_LATER.flags,
)

SGLANG = AcceptedFlags(
    engine="sglang",
    version="docs@004813e1",
    source=(
        "github.com/sgl-project/sglang@004813e1dd464844bd92ddbca5cab8c024a75f78 "
        "docs/advanced_features/server_arguments.md"
    ),
    flags=_flags(
        """
        --model-path --model --tokenizer-path --tokenizer-mode --tokenizer-worker-num
        --skip-tokenizer-init --load-format --model-loader-extra-config --trust-remote-code
        --context-length --is-embedding --enable-multimodal --revision --model-impl
        --host --port --fastapi-root-path --grpc-mode --skip-server-warmup --warmups
        --nccl-port --dtype --quantization --quantization-param-path --kv-cache-dtype
        --mem-fraction-static --max-running-requests --max-queued-requests
        --max-total-tokens --chunked-prefill-size --max-prefill-tokens --schedule-policy
        --schedule-conservativeness --page-size --device --tensor-parallel-size --tp-size
        --pipeline-parallel-size --pp-size --pp-max-micro-batch-size --stream-interval
        --random-seed --watchdog-timeout --dist-timeout --download-dir --base-gpu-id
        --gpu-id-step --log-level --log-level-http --log-requests --log-requests-level
        --enable-metrics --enable-metrics-for-all-schedulers --api-key --served-model-name
        --chat-template --completion-template --enable-cache-report --reasoning-parser
        --tool-call-parser --data-parallel-size --dp-size --load-balance-method
        --dist-init-addr --nccl-init-addr --nnodes --node-rank --json-model-override-args
        --enable-lora --max-lora-rank --lora-paths --max-loras-per-batch
        --attention-backend
        """
    ),
)

LLAMACPP = AcceptedFlags(
    engine="llamacpp",
    version="tools/server README@25d5b0c5",
    source=(
        "github.com/ggml-org/llama.cpp@25d5b0c53f9a146f3d7a99a18610d9d623b5041e "
        "tools/server/README.md (generated by llama-gen-docs from common/arg.cpp)"
    ),
    flags=_flags(
        """
        -t --threads -tb --threads-batch -c --ctx-size -n --predict --n-predict
        -b --batch-size -ub --ubatch-size --keep -fa --flash-attn -ctk --cache-type-k
        -ctv --cache-type-v -np --parallel --mlock --no-mmap --numa -dev --device
        -ngl --gpu-layers --n-gpu-layers -sm --split-mode -ts --tensor-split -mg --main-gpu
        -m --model -lv --verbosity --log-verbosity --log-disable -s --seed --pooling
        -cb --cont-batching -nocb --no-cont-batching -a --alias --host --port --path
        --api-prefix --no-webui --embedding --embeddings --reranking --rerank --api-key
        -to --timeout --threads-http --cache-reuse --metrics --props --slots --no-slots
        --jinja --chat-template --chat-template-file
        """
    ),
)

TRTLLM = AcceptedFlags(
    engine="trtllm",
    version="trtllm-serve @4c05a748 (1.x, PyTorch default backend)",
    source=(
        "github.com/NVIDIA/TensorRT-LLM@4c05a74891e4df8066f08ed4ce14b0972abe4e25 "
        "tensorrt_llm/commands/serve.py (click options of `serve`)"
    ),
    flags=_flags(
        """
        --tokenizer --host --port --backend --log_level --max_beam_width --max_batch_size
        --max_num_tokens --max_seq_len --tp_size --pp_size --ep_size --cluster_size
        --gpus_per_node --kv_cache_free_gpu_memory_fraction --num_postprocess_workers
        --trust_remote_code --extra_llm_api_options --reasoning_parser
        --metadata_server_config_file --server_role
        --fail_fast_on_attention_window_too_large --disagg_cluster_uri
        --enable_chunked_prefill --media_io_kwargs
        """
    ),
)

MINDIE = AcceptedFlags(
    engine="mindie",
    version="config.json (MindIE 2.x service configuration)",
    source="MindIE takes its settings from config.json, not from flags",
    flags=frozenset(),
)

MINDIE_CONFIG_KEYS_SOURCE = (
    "github.com/verylucky01/MindIE-LLM@2ad5b22e (mirror of Huawei MindIE-LLM docs) "
    "docs/zh/user_guide/user_manual/service_parameter_configuration.md"
)
MINDIE_CONFIG_KEYS = _flags(
    """
    Version ServerConfig BackendConfig LogConfig
    ipAddress managementIpAddress port managementPort metricsPort allowAllZeroIpListening
    maxLinkNum httpsEnabled fullTextEnabled inferMode interCommTLSEnabled openAiSupport
    tokenTimeout e2eTimeout maxRequestLength
    backendName modelInstanceNumber npuDeviceIds tokenizerProcessNumber
    multiNodesInferEnabled multiNodesInferPort interNodeTLSEnabled
    ModelDeployConfig ScheduleConfig maxSeqLen maxInputTokenLen truncation ModelConfig
    modelInstanceType modelName modelWeightPath worldSize cpuMemSize npuMemSize backendType
    trustRemoteCode
    templateType templateName cacheBlockSize maxPrefillBatchSize maxPrefillTokens
    prefillTimeMsPerReq prefillPolicyType decodeTimeMsPerReq decodePolicyType maxBatchSize
    maxIterTimes maxPreemptCount supportSelectBatch maxQueueDelayMicroseconds
    """
)

ACCEPTED_FLAGS: tuple[AcceptedFlags, ...] = (
    VLLM,
    VLLM_LATER,
    VLLM_MTT,
    SGLANG,
    LLAMACPP,
    TRTLLM,
    MINDIE,
)


def accepted_flags(engine: str) -> frozenset[str]:
    """Union of the pinned flag lists recorded for ``engine``."""
    lists = [entry.flags for entry in ACCEPTED_FLAGS if entry.engine == engine]
    if not lists:
        raise ValueError(f"no accepted-flag list recorded for engine {engine!r}")
    return frozenset().union(*lists)
