"""What a whole-card policy would cost: one trace of 100 services, placed twice.

The same seeded trace is replayed through the real placement code (``core.placement``:
``FleetIndex`` + ``place`` + ``book``, the scheduler's own calls, default ``Policy`` and
``Reservation`` as shipped) twice on an unbounded fleet of one node kind:

- **HeteroFlow**: inference instances on one card stack by memory commitment within
  their sharing key (tenant, or its sharing group — ``filters.card_admits``: a card
  holds one key's work); TP replicas, training and containers take whole cards; at
  night, services with a pause window sleep and training of the same key may borrow
  their cards (F5);
- **whole card per instance** (the policy GPUStack applies to vLLM at its defaults:
  ``--gpu-memory-utilization 0.9`` claimed on each card, so no second instance fits):
  the same demands with every one-card instance's commitment forced to 100 %, nothing
  sleeps, nothing is lent. Same packer, same order, same fleet kind.

"Unbounded fleet": the replay starts with no node and adds one fresh node of the kind
only when a task fits nowhere (the scheduler's ``Unplaced``), then places it again — a
fleet bought node by node as the trace needs it. Placement order is the trace's
arrival order (seeded shuffle), not sorted by size (first-fit decreasing would flatter
both policies and hide fragmentation).

**The trace** (``--seed``, default 18; 100 services, figures printed at the start):

- 55 *small* services (0.5B-8B): Qwen2.5 0.5/1.5/3/7B, Llama-3.2 1/3B, Llama-3.1-8B,
  Mistral-7B-v0.3, Phi-3-mini, served as Hugging Face bf16 by vLLM or as GGUF Q4_K_M by
  llama.cpp (about one in three), 1-4 replicas (45/30/15/10 %);
- 20 *mid* services (13B-34B): Qwen2.5-14B, Llama-2-13B, Mistral-Small-24B, Gemma-2-27B,
  Qwen2.5-32B (bf16, AWQ, GGUF Q8_0), Yi-34B, one card each at 65-90 %, 1-3 replicas
  (60/30/10 %);
- 15 *TP* services, written out in ``TP_SERVICES``: Llama-3.1/3.3-70B (bf16 TP-4, FP8
  TP-2), Qwen2.5-72B (bf16 TP-4, AWQ TP-2), Mixtral-8x7B (TP-2), Mixtral-8x22B (TP-8),
  Llama-3.1-405B FP8 (TP-8), 1-3 replicas, whole cards;
- 10 *training / container* jobs, written out in ``JOBS``: 1-8 whole cards each; four
  of them (tenant ``research``) run only at night, when research's services sleep.

Memory estimates come from ``core/estimate.py`` itself: ``estimate_hf`` on the models'
published ``config.json`` figures (``CONFIGS``: hidden size, layers, heads, kv-heads,
intermediate size, vocabulary, dtype / quantization) and ``estimate_gguf_meta`` on GGUF
keys built from the same figures with the published Q4_K_M / Q8_0 file sizes (rounded).
The KV part is the service's *KV pool* (``kv_tokens``): the tokens it holds at once
across concurrent requests (vLLM fills its commitment with KV cache; llama.cpp's ``-c``
is the total over its ``-np`` slots), drawn from a per-model list that keeps small
services at 5-45 % of an 80 GB card and mid ones at 65-90 %. A one-card
instance's commitment (``gpu_memory_utilization``) is its estimate as a share of the
card it is sized for, rounded up to 5 %. TP instances carry estimate / TP per card
(as ``services/placement/planning.py`` books it). Training memory is not estimated by
``core/estimate.py``: each job declares a per-card need in ``JOBS``.

**Tenants**: search and support share one sharing group (``product``), labs and sandbox
another (``eng``), research and platform are alone: four sharing keys. Research's
inference services have a night pause window (they sleep), and the four night jobs are
research's, so they may borrow those cards.

**Fleets**: 8xH100 80 GB (``testing/clusters`` ``h100-sxm-8``); 8xA100 40 GB (the
``a100-mig-8`` kind with 40 GB cards — no such kind file exists); a mixed fleet of
2xA10 24 GB, 8xA100 40 GB and 8xH100 80 GB, where every task names the smallest card
model that holds it (``gpu_type``; both policies get the same pins). Where a
service's per-card estimate does not fit a fleet's card, its TP degree is doubled (an
operator would serve a 32B bf16 model TP-2 on 40 GB cards), in both policies; the
printout counts them.

**Figures** (per fleet and policy): cards used (cards holding any work, day or night);
nodes used, and cards provisioned (nodes x cards per node: what one buys); mean card
memory utilisation = memory the work asks for / memory of the cards (used, and
provisioned), where a one-card inference instance asks for its own commitment (in both
policies — the whole-card policy books 100 % but the service needs what it needs) and
whole-card work for the whole card, taking each card at its fullest moment (day or
night); night jobs that borrowed; the ratio whole-card / HeteroFlow (cards, nodes, and
GiB of cards used — the comparable one on the mixed fleet). Sensitivity (H100): all
services in one tenant, each tenant alone (no sharing groups), each service its own
tenant; the default inference cap (8 containers per node) raised to 32; night borrowing
off; and "GPUStack at defaults" (vLLM instances whole card, GGUF instances share by
estimate across all tenants, as its llama-box path claims VRAM by estimate). An audit
of the occupants (one sharing key per card, awake commitments <= 100 %, whole-card work
alone, awake estimates within the card less its reservation) must find 0 cards at fault
(``double_bookings``). ``--spread N`` (default 20) replays seeds 1..N on 8xH100 for the
headline ratio's spread.

Last line: one JSON object. A full run takes about 2 s (no ``--quick``).
Run: ``.venv/bin/python bench/whole_card.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from heteroflow.core.estimate import estimate_gguf_meta, estimate_hf
from heteroflow.core.placement import (
    CardView,
    FleetIndex,
    NodeView,
    Placement,
    Policy,
    Reservation,
    TaskDemand,
    Unplaced,
    book,
    place,
)
from heteroflow.testing import clusters

SEED = 18
POLICY = Policy()  # the shipped defaults (settings.placement_policy() with no overrides)
RESERVATION = Reservation()  # B3 defaults: 500 MiB + 10 % of each card kept free
PORT_POOL = range(20000, 30000)
GB = 10**9

# --------------------------------------------------------------------------- models

# The published config.json figures of each architecture (the subset core/estimate.py
# reads). GGUF keys are built from the same figures (gguf_meta).
CONFIGS: dict[str, dict[str, Any]] = {}


def _cfg(name: str, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
         vocab: int, tie: bool, max_pos: int, *, head_dim: int = 0, experts: int = 0,
         quant: dict[str, Any] | None = None, dtype: str = "bfloat16") -> None:
    c: dict[str, Any] = {
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "intermediate_size": inter, "vocab_size": vocab,
        "tie_word_embeddings": tie, "max_position_embeddings": max_pos, "torch_dtype": dtype,
    }
    if head_dim:
        c["head_dim"] = head_dim
    if experts:
        c["num_local_experts"] = experts
    if quant:
        c["quantization_config"] = quant
    CONFIGS[name] = c


_AWQ = {"quant_method": "awq", "bits": 4}
_FP8 = {"quant_method": "fp8"}
_cfg("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, True, 32768)
_cfg("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, True, 32768)
_cfg("qwen2.5-3b", 2048, 36, 16, 2, 11008, 151936, True, 32768)
_cfg("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, False, 32768)
_cfg("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, True, 131072, head_dim=64)
_cfg("llama-3.2-3b", 3072, 28, 24, 8, 8192, 128256, True, 131072, head_dim=128)
_cfg("llama-3.1-8b", 4096, 32, 32, 8, 14336, 128256, False, 131072)
_cfg("mistral-7b-v0.3", 4096, 32, 32, 8, 14336, 32768, False, 32768)
_cfg("phi-3-mini", 3072, 32, 32, 32, 8192, 32064, False, 4096)
_cfg("qwen2.5-14b", 5120, 48, 40, 8, 13824, 152064, False, 32768)
_cfg("llama-2-13b", 5120, 40, 40, 40, 13824, 32000, False, 4096)
_cfg("mistral-small-24b", 5120, 40, 32, 8, 32768, 131072, False, 32768, head_dim=128)
_cfg("gemma-2-27b", 4608, 46, 32, 16, 36864, 256000, True, 8192, head_dim=128)
_cfg("qwen2.5-32b", 5120, 64, 40, 8, 27648, 152064, False, 32768)
_cfg("qwen2.5-32b-awq", 5120, 64, 40, 8, 27648, 152064, False, 32768, quant=_AWQ,
     dtype="float16")
_cfg("yi-34b", 7168, 60, 56, 8, 20480, 64000, False, 4096)
_cfg("llama-3.1-70b", 8192, 80, 64, 8, 28672, 128256, False, 131072)
_cfg("llama-3.1-70b-fp8", 8192, 80, 64, 8, 28672, 128256, False, 131072, quant=_FP8)
_cfg("qwen2.5-72b", 8192, 80, 64, 8, 29568, 152064, False, 32768)
_cfg("qwen2.5-72b-awq", 8192, 80, 64, 8, 29568, 152064, False, 32768, quant=_AWQ,
     dtype="float16")
_cfg("mixtral-8x7b", 4096, 32, 32, 8, 14336, 32000, False, 32768, experts=8)
_cfg("mixtral-8x22b", 6144, 56, 48, 8, 16384, 32768, False, 65536, experts=8)
_cfg("llama-3.1-405b-fp8", 16384, 126, 128, 8, 53248, 128256, False, 131072, quant=_FP8)

# GGUF architecture name per config (general.architecture)
_GGUF_ARCH = {"qwen2": ("qwen2.5",), "llama": ("llama", "mistral"), "phi3": ("phi-3",)}


@dataclass(frozen=True)
class Model:
    """A model as services run it: config, format, and the KV pools drawn from."""

    config: str
    fmt: str  # "hf" (vLLM, bf16 / quantized checkpoint) | "gguf" (llama.cpp)
    kv_tokens: tuple[int, ...]
    file_gb: float = 0.0  # GGUF: the published file size (decimal GB, rounded)
    quant: str = ""  # GGUF quantization, for the name

    @property
    def name(self) -> str:
        return f"{self.config}-{self.quant.lower()}" if self.quant else self.config


K = 1024
SMALL: tuple[Model, ...] = (
    Model("qwen2.5-0.5b", "hf", (256 * K, 512 * K)),
    Model("qwen2.5-1.5b", "hf", (256 * K, 512 * K)),
    Model("qwen2.5-3b", "hf", (128 * K, 256 * K)),
    Model("qwen2.5-7b", "hf", (128 * K, 256 * K)),
    Model("llama-3.2-1b", "hf", (128 * K, 256 * K)),
    Model("llama-3.2-3b", "hf", (64 * K, 128 * K)),
    Model("llama-3.1-8b", "hf", (64 * K, 128 * K)),
    Model("mistral-7b-v0.3", "hf", (64 * K, 128 * K)),
    Model("phi-3-mini", "hf", (32 * K, 64 * K)),
    Model("qwen2.5-0.5b", "gguf", (32 * K, 64 * K), 0.49, "Q4_K_M"),
    Model("qwen2.5-3b", "gguf", (32 * K, 64 * K, 128 * K), 2.10, "Q4_K_M"),
    Model("qwen2.5-7b", "gguf", (32 * K, 64 * K, 128 * K), 4.68, "Q4_K_M"),
    Model("llama-3.2-3b", "gguf", (32 * K, 64 * K), 2.02, "Q4_K_M"),
    Model("llama-3.1-8b", "gguf", (32 * K, 64 * K, 128 * K), 4.92, "Q4_K_M"),
    Model("mistral-7b-v0.3", "gguf", (32 * K, 64 * K), 4.37, "Q4_K_M"),
    Model("phi-3-mini", "gguf", (16 * K, 32 * K), 2.39, "Q4_K_M"),
)
SMALL_WEIGHTS = (7, 7, 7, 7, 6, 6, 7, 6, 5, 4, 4, 4, 3, 4, 3, 3)  # HF ~2/3, GGUF ~1/3
MID: tuple[Model, ...] = (
    Model("qwen2.5-14b", "hf", (128 * K,)),
    Model("llama-2-13b", "hf", (32 * K,)),
    Model("mistral-small-24b", "hf", (32 * K, 128 * K)),
    Model("gemma-2-27b", "hf", (8 * K, 32 * K)),
    Model("qwen2.5-32b", "hf", (8 * K,)),
    Model("qwen2.5-32b-awq", "hf", (128 * K,)),
    Model("yi-34b", "hf", (8 * K,)),
    Model("qwen2.5-32b", "gguf", (64 * K,), 34.8, "Q8_0"),
)

# --------------------------------------------------------------------------- services

TENANTS: dict[str, str] = {  # tenant -> sharing group ("" = none)
    "search": "product", "support": "product", "labs": "eng", "sandbox": "eng",
    "research": "", "platform": "",
}
NIGHT_TENANT = "research"  # its inference services pause at night (a window: they sleep)
SMALL_TENANTS = (("platform", 25), ("search", 20), ("support", 15), ("labs", 15),
                 ("sandbox", 10), ("research", 15))
MID_TENANTS = (("platform", 20), ("search", 25), ("support", 20), ("labs", 10),
               ("sandbox", 5), ("research", 20))
SMALL_REPLICAS = ((1, 45), (2, 30), (3, 15), (4, 10))
MID_REPLICAS = ((1, 60), (2, 30), (3, 10))

# (tenant, model config, TP degree, KV pool tokens, replicas)
TP_SERVICES: tuple[tuple[str, str, int, int, int], ...] = (
    ("search", "llama-3.1-70b", 4, 128 * K, 2),
    ("support", "llama-3.1-70b-fp8", 2, 64 * K, 2),
    ("platform", "qwen2.5-72b", 4, 128 * K, 1),
    ("platform", "qwen2.5-72b-awq", 2, 128 * K, 2),
    ("search", "mixtral-8x7b", 2, 128 * K, 1),
    ("labs", "mixtral-8x22b", 8, 128 * K, 1),
    ("research", "llama-3.1-405b-fp8", 8, 128 * K, 1),
    ("research", "llama-3.1-70b", 4, 64 * K, 1),  # a DeepSeek-R1 distill: Llama-70B shape
    ("support", "qwen2.5-72b", 4, 64 * K, 1),
    ("sandbox", "llama-3.1-70b-fp8", 2, 32 * K, 1),
    ("labs", "qwen2.5-72b-awq", 2, 64 * K, 1),
    ("search", "llama-3.1-70b-fp8", 2, 64 * K, 3),
    ("platform", "llama-3.1-70b", 4, 128 * K, 1),
    ("support", "mixtral-8x7b", 2, 64 * K, 1),
    ("research", "llama-3.1-70b-fp8", 2, 64 * K, 1),
)

# (tenant, name, task type, cards, declared per-card need in GB, night only)
JOBS: tuple[tuple[str, str, str, int, int, bool], ...] = (
    ("research", "sft-8b-full", "training", 8, 60, True),
    ("research", "lora-70b", "training", 4, 60, True),
    ("research", "dpo-8b", "training", 4, 55, True),
    ("research", "eval-harness", "container", 1, 20, True),
    ("research", "ablation-1b-pretrain", "training", 8, 70, False),
    ("labs", "lora-8b", "training", 1, 40, False),
    ("labs", "embedding-finetune", "training", 2, 30, False),
    ("platform", "batch-embed", "container", 1, 12, False),
    ("sandbox", "notebook", "container", 1, 16, False),
    ("search", "reranker-train", "training", 2, 30, False),
)


@dataclass(frozen=True)
class Service:
    """One service of the trace: ``replicas`` instances of ``cards`` cards each."""

    name: str
    tenant: str
    kind: str  # small | mid | tp | training | container
    model: str
    fmt: str  # hf | gguf | "" (training, containers)
    replicas: int
    cards: int  # per instance; 1 = an inference instance may share its card
    estimate_mb: int  # the whole instance (all its cards), MiB
    kv_tokens: int = 0
    commitment_pct: int = 0  # declared share of a card; 0 = derived from the estimate
    night_sleep: bool = False  # paused at night by a window: sleeps, cards lendable
    night_only: bool = False  # a job that runs only in the night window

    @property
    def task_type(self) -> str:
        return self.kind if self.kind in ("training", "container") else "inference"

    @property
    def whole(self) -> bool:
        return self.cards > 1 or self.task_type != "inference"


def gguf_meta(config: str) -> dict[str, Any]:
    """GGUF key/values for an architecture, from the same config figures."""
    c = CONFIGS[config]
    arch = next(a for a, prefixes in _GGUF_ARCH.items() if config.startswith(prefixes))
    heads = c["num_attention_heads"]
    return {
        "general.architecture": arch,
        f"{arch}.block_count": c["num_hidden_layers"],
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": c["num_key_value_heads"],
        f"{arch}.embedding_length": c["hidden_size"],
        f"{arch}.attention.key_length": c.get("head_dim", c["hidden_size"] // heads),
        f"{arch}.context_length": c["max_position_embeddings"],
    }


def estimate_mb(m: Model, kv_tokens: int) -> int:
    """core/estimate.py's estimate (weights + KV for the pool + overhead), MiB."""
    if m.fmt == "gguf":
        est = estimate_gguf_meta(gguf_meta(m.config), file_bytes=int(m.file_gb * GB),
                                 context_tokens=kv_tokens)
    else:
        est = estimate_hf(CONFIGS[m.config], context_tokens=kv_tokens)
    return est.total_mb


def _pick(rng: random.Random, weighted: Sequence[tuple[Any, int]]) -> Any:
    return rng.choices([v for v, _ in weighted], [w for _, w in weighted])[0]


def make_trace(seed: int = SEED) -> list[Service]:
    """The 100 services in arrival order (seeded); night-only jobs last."""
    rng = random.Random(seed)
    out: list[Service] = []

    def inference(kind: str, models: Sequence[Model], weights: Sequence[int],
                  tenants: Sequence[tuple[str, int]], replicas: Sequence[tuple[int, int]],
                  count: int) -> None:
        for i in range(count):
            m = rng.choices(models, weights)[0]
            tenant = _pick(rng, tenants)
            kv = rng.choice(m.kv_tokens)
            out.append(Service(
                f"{tenant}-{m.name}-{kind}{i:02d}", tenant, kind, m.name, m.fmt,
                _pick(rng, replicas), 1, estimate_mb(m, kv), kv,
                night_sleep=tenant == NIGHT_TENANT,
            ))

    inference("small", SMALL, SMALL_WEIGHTS, SMALL_TENANTS, SMALL_REPLICAS, 55)
    inference("mid", MID, [1] * len(MID), MID_TENANTS, MID_REPLICAS, 20)
    for i, (tenant, config, tp, kv, replicas) in enumerate(TP_SERVICES):
        est = estimate_hf(CONFIGS[config], context_tokens=kv).total_mb
        out.append(Service(f"{tenant}-{config}-tp{tp}-{i:02d}", tenant, "tp", config, "hf",
                           replicas, tp, est, kv, night_sleep=tenant == NIGHT_TENANT))
    day_jobs: list[Service] = []
    night_jobs: list[Service] = []
    for tenant, name, task_type, n, per_card_gb, night in JOBS:
        job = Service(f"{tenant}-{name}", tenant, task_type, "", "", 1, n,
                      n * per_card_gb * GB // (1 << 20), night_only=night)
        (night_jobs if night else day_jobs).append(job)
    day = out + day_jobs
    rng.shuffle(day)
    return day + night_jobs


# --------------------------------------------------------------------------- fleets

@dataclass(frozen=True)
class NodeKind:
    """A simulated node kind (``testing/clusters``), possibly with other cards."""

    name: str
    source: clusters.ClusterKind
    card_model: str
    card_mb: int

    @property
    def cards(self) -> int:
        return len(self.source.cards)

    @property
    def usable_mb(self) -> int:
        """What one empty card admits: total minus the B3 reservation."""
        return self.card_mb - RESERVATION.of(self.card_mb)

    def node(self, i: int) -> NodeView:
        k = self.source
        cards = [
            CardView(
                index=c.index, vendor=c.vendor, model=self.card_model,
                memory_total_mb=self.card_mb, mig=c.mig_capable, mps=c.mps_capable,
                nvlink_peers=frozenset(c.nvlink_peers),
            )
            for c in k.cards
        ]
        nid = f"{self.name}-{i:04d}"
        return NodeView(
            id=nid, name=nid, online=True, cards=cards, cpu_count=k.cpu_count,
            memory_total_mb=k.memory_total_mb, cpu_percent=k.cpu_percent,
            memory_percent=k.memory_percent, labels=dict(k.labels), runtime=k.runtime,
        )


def node_kind(kind: str, *, card_mb: int = 0, card_model: str = "", name: str = "") -> NodeKind:
    src = clusters.load(kind)
    return NodeKind(name or kind, src, card_model or src.cards[0].model,
                    card_mb or src.cards[0].memory_total_mb)


@dataclass(frozen=True)
class Fleet:
    name: str
    kinds: tuple[NodeKind, ...]  # several: each task names the smallest card that holds it

    @property
    def mixed(self) -> bool:
        return len(self.kinds) > 1


def fleets() -> list[Fleet]:
    h100 = node_kind("h100-sxm-8")
    a100_40 = node_kind("a100-mig-8", card_mb=40960, card_model="NVIDIA A100-SXM4-40GB",
                        name="a100-40gb-8")
    a10 = node_kind("a10-2")
    return [
        Fleet("8xH100 80GB", (h100,)),
        Fleet("8xA100 40GB", (a100_40,)),
        Fleet("mixed 2xA10 + 8xA100 40GB + 8xH100", (a10, a100_40, h100)),
    ]


@dataclass(frozen=True)
class Sized:
    """A service as one fleet serves it."""

    service: Service
    kind: NodeKind
    cards: int  # per instance, after any TP doubling
    per_card_mb: int
    pct: int  # the commitment of a one-card instance on this card

    @property
    def whole(self) -> bool:
        return self.cards > 1 or self.service.task_type != "inference"


def size(s: Service, fleet: Fleet) -> Sized | None:
    """The smallest card kind that holds the service at its own TP degree; else its
    TP degree doubled until it fits (both policies alike); None if nothing holds it."""
    kinds = sorted(fleet.kinds, key=lambda k: (k.card_mb, k.cards))
    degrees = [s.cards]
    while degrees[-1] < max(k.cards for k in kinds):
        degrees.append(degrees[-1] * 2)
    for cards in degrees:
        per_card = -(-s.estimate_mb // cards)
        for k in kinds:
            if cards <= k.cards and per_card <= k.usable_mb:
                pct = s.commitment_pct or min(100, 5 * math.ceil(per_card * 20 / k.card_mb))
                return Sized(s, k, cards, per_card, pct)
    return None


# --------------------------------------------------------------------------- replay

@dataclass(frozen=True)
class Variant:
    name: str
    whole_card: bool = False  # every one-card instance's commitment forced to 100 %
    gguf_shares: bool = False  # with whole_card: GGUF keeps its commitment, one key for all
    tenancy: str = "traced"  # traced | one | tenants | services
    sleep: bool = True  # night-window services sleep, their cards lendable to training
    policy: Policy = POLICY


HETEROFLOW = Variant("heteroflow")
WHOLE_CARD = Variant("whole_card", whole_card=True, sleep=False)


def share_key(s: Service, v: Variant) -> str:
    if v.whole_card and v.gguf_shares and s.fmt == "gguf":
        return "gguf"  # GPUStack's llama-box path packs by estimate, tenants aside
    if v.tenancy == "one":
        return "all"
    if v.tenancy == "services":
        return s.name
    if v.tenancy == "tenants":
        return s.tenant
    return TENANTS.get(s.tenant) or s.tenant


def demand(z: Sized, replica: int, v: Variant, pinned: bool) -> TaskDemand:
    s = z.service
    pct = z.pct
    if v.whole_card and not z.whole and not (v.gguf_shares and s.fmt == "gguf"):
        pct = 100
    return TaskDemand(
        task_id=f"{s.name}/{replica}", gpu_required=z.cards,
        gpu_type=z.kind.card_model if pinned else "",
        gpu_memory_utilization=pct if not z.whole else 90,  # whole cards book 100 anyway
        estimated_gpu_memory_mb=z.per_card_mb, memory_mb=0,
        host_ports=(0,) if s.task_type == "inference" else (),
        task_type=s.task_type, share_key=share_key(s, v), tenant_id=s.tenant,
    )


def need_mb(z: Sized) -> float:
    """Memory one instance asks of each of its cards: its commitment, or whole cards."""
    return float(z.kind.card_mb) if z.whole else z.pct / 100 * z.kind.card_mb


@dataclass
class Outcome:
    fleet: str
    variant: str
    services: int = 0
    instances: int = 0
    left_out: list[str] = field(default_factory=list)  # services no card of the fleet holds
    resized: list[str] = field(default_factory=list)  # TP degree doubled to fit
    nodes: dict[str, int] = field(default_factory=dict)  # node kind -> nodes
    cards_per_node: dict[str, int] = field(default_factory=dict)
    cards_used: dict[str, int] = field(default_factory=dict)  # node kind -> cards
    card_mb: dict[str, int] = field(default_factory=dict)
    need_mb: float = 0.0  # each used card at its fullest moment, summed
    borrowed: int = 0  # night jobs placed on sleeping services' cards
    double_bookings: int = 0  # cards breaking a sharing rule at the end (audit): must be 0

    @property
    def total_cards(self) -> int:
        return sum(self.cards_used.values())

    @property
    def total_nodes(self) -> int:
        return sum(self.nodes.values())

    @property
    def provisioned(self) -> int:
        return sum(n * self.cards_per_node[k] for k, n in self.nodes.items())

    @property
    def used_gib(self) -> float:
        return sum(n * self.card_mb[k] for k, n in self.cards_used.items()) / 1024

    @property
    def util_used(self) -> float:
        mb = self.used_gib * 1024
        return self.need_mb / mb if mb else 0.0

    @property
    def util_provisioned(self) -> float:
        mb = sum(n * self.cards_per_node[k] * self.card_mb[k] for k, n in self.nodes.items())
        return self.need_mb / mb if mb else 0.0


class _Replay:
    """One fleet growing node by node under the real placement code."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.nodes: list[NodeView] = []
        self.by_id: dict[str, NodeView] = {}
        self.kind_of: dict[str, NodeKind] = {}
        self.index = self._index()

    def _index(self) -> FleetIndex:
        """Built as services/placement/scheduling.py builds it (with the B3 reservation where the
        index takes one)."""
        p = self.policy
        kw: dict[str, Any] = {}
        if "reservation" in inspect.signature(FleetIndex).parameters:
            kw["reservation"] = RESERVATION
        return FleetIndex(self.nodes, pack=p.packs, load_threshold_pct=p.load_threshold_pct,
                          inference_cap=p.inference_cap, **kw)

    def place(self, t: TaskDemand, kind: NodeKind) -> Placement:
        r = place(t, self.index.order(t), RESERVATION, PORT_POOL, self.policy)
        if isinstance(r, Unplaced):  # nothing fits: buy one node of the kind, try again
            n = kind.node(sum(1 for k in self.kind_of.values() if k is kind))
            self.nodes.append(n)
            self.by_id[n.id] = n
            self.kind_of[n.id] = kind
            self.index = self._index()
            r = place(t, self.index.order(t), RESERVATION, PORT_POOL, self.policy)
            if isinstance(r, Unplaced):
                raise RuntimeError(f"{t.task_id} does not fit an empty {kind.name}: {r.reason}")
        node = self.by_id[r.node_id]
        book(node, r, t)
        self.index.update(node)
        return r

    def sleep(self, node_id: str, task_id: str) -> None:
        """Mark a placed task sleeping, as services/placement/fleet.py reads a ``sleeping`` task."""
        node = self.by_id[node_id]
        o = next(o for o in node.occupants if o.task_id == task_id)
        o.sleeping = True
        for c in node.cards:
            if c.index in o.gpu_ids:
                c.sleeping += 1
                c.sleeping_mb += o.per_card_mb
                c.sleeping_pct += o.per_card_pct
        self.index.update(node)


def replay(trace: Iterable[Service], fleet: Fleet, v: Variant) -> Outcome:
    """Place the trace (day, then night) on a fleet grown on demand; count what it took."""
    trace = list(trace)
    out = Outcome(fleet.name, v.name, services=len(trace))
    sized: list[Sized] = []
    for s in trace:
        z = size(s, fleet)
        if z is None:
            out.left_out.append(s.name)
            continue
        if z.cards != s.cards:
            out.resized.append(s.name)
        sized.append(z)
    r = _Replay(v.policy)
    placed: list[tuple[Sized, Placement, str, str]] = []  # service, placement, task, phase
    for phase in ("day", "night"):
        if phase == "night" and v.sleep:  # the pause window: research's services sleep
            for z, p, task_id, _ in placed:
                if z.service.night_sleep:
                    r.sleep(p.node_id, task_id)
        for z in sized:
            if z.service.night_only != (phase == "night"):
                continue
            for i in range(z.service.replicas):
                t = demand(z, i, v, fleet.mixed)
                p = r.place(t, z.kind)
                placed.append((z, p, t.task_id, phase))
                out.instances += 1
                out.borrowed += int(p.borrowed)
    # each card at its fullest moment: the day, or the night (sleepers ask nothing then)
    day: dict[tuple[str, int], float] = {}
    night: dict[tuple[str, int], float] = {}
    for z, p, _, phase in placed:
        asleep = v.sleep and z.service.night_sleep
        for g in p.gpu_ids:
            key = (p.node_id, g)
            if phase == "day":
                day[key] = day.get(key, 0.0) + need_mb(z)
            if phase == "night" or not asleep:
                night[key] = night.get(key, 0.0) + need_mb(z)
    out.need_mb = sum(max(day.get(k, 0.0), night.get(k, 0.0)) for k in day.keys() | night)
    for n in r.nodes:
        k = r.kind_of[n.id]
        out.nodes[k.name] = out.nodes.get(k.name, 0) + 1
        out.cards_per_node[k.name] = k.cards
        out.card_mb[k.name] = k.card_mb
        out.cards_used[k.name] = out.cards_used.get(k.name, 0) + sum(
            1 for c in n.cards if c.holders > 0)
    out.double_bookings = audit(r.nodes)
    return out


def audit(nodes: Iterable[NodeView]) -> int:
    """Cards that break a rule at night (the fullest moment), checked from the occupants
    rather than the card counters: more than one sharing key; awake commitments over
    100 %; a whole-card holder beside other awake work; awake estimates over the card's
    memory less the reservation."""
    bad = 0
    for n in nodes:
        for c in n.cards:
            here = [o for o in n.occupants if c.index in o.gpu_ids]
            awake = [o for o in here if not o.sleeping]
            if (
                len({o.share_key for o in here}) > 1
                or sum(o.per_card_pct for o in awake) > 100
                or (any(o.whole for o in awake) and len(awake) > 1)
                or sum(o.per_card_mb for o in awake)
                > c.memory_total_mb - RESERVATION.of(c.memory_total_mb)
            ):
                bad += 1
    return bad


# --------------------------------------------------------------------------- report

def ratio(whole: Outcome, ours: Outcome) -> float:
    """Cards used, whole-card / HeteroFlow (1.0 = sharing saved nothing)."""
    return round(whole.total_cards / ours.total_cards, 3) if ours.total_cards else 0.0


def node_ratio(whole: Outcome, ours: Outcome) -> float:
    return round(whole.total_nodes / ours.total_nodes, 3) if ours.total_nodes else 0.0


def describe(trace: Sequence[Service], fleet: Fleet) -> dict[str, Any]:
    """Composition of the trace and its commitments on one fleet."""
    by_kind: dict[str, list[Service]] = {}
    for s in trace:
        by_kind.setdefault(s.kind, []).append(s)
    pct = {k: sorted(z.pct for s in v if (z := size(s, fleet)) is not None and not z.whole)
           for k, v in by_kind.items()}
    return {
        "services": {k: len(v) for k, v in by_kind.items()},
        "instances": {k: sum(s.replicas for s in v) for k, v in by_kind.items()},
        "gguf": sum(1 for s in trace if s.fmt == "gguf"),
        "pct": {k: v for k, v in pct.items() if v},
        "whole_cards": sum(s.replicas * s.cards for s in trace if s.whole),
    }


def _row(o: Outcome, pair: tuple[Outcome, Outcome] | None) -> str:
    kinds = " + ".join(f"{n}x{k}" for k, n in o.nodes.items())
    r = f"{ratio(*pair):.2f} / {node_ratio(*pair):.2f}" if pair else ""
    return (f"  {o.variant:<30} {o.total_cards:>5} {o.provisioned:>6} {o.total_nodes:>5} "
            f"{o.used_gib:>8,.0f} {o.util_used:>6.0%} {o.util_provisioned:>6.0%} "
            f"{o.borrowed:>4}  {r:<12} {kinds}")


HEADER = (f"  {'policy':<30} {'cards':>5} {'provis':>6} {'nodes':>5} {'GiB used':>8} "
          f"{'util':>6} {'u/prov':>6} {'borr':>4}  {'ratio':<12} node kinds\n"
          f"  {'':<30} {'used':>5} {'cards':>6} {'':>5} {'':>8} {'':>6} {'':>6} {'':>4}  "
          f"{'cards/nodes':<12}")

CAP32 = dataclasses.replace(POLICY, inference_cap=32)
# Sensitivity runs (H100 fleet): (variant, the baseline run, the HeteroFlow run) whose
# cards and nodes make its ratio, baseline / HeteroFlow
SENSITIVITY: tuple[tuple[Variant, str, str], ...] = (
    (Variant("gpustack_defaults", whole_card=True, gguf_shares=True, sleep=False),
     "gpustack_defaults", "heteroflow"),
    (Variant("heteroflow_no_borrowing", sleep=False), "whole_card", "heteroflow_no_borrowing"),
    (Variant("heteroflow_one_tenant", tenancy="one"), "whole_card", "heteroflow_one_tenant"),
    (Variant("heteroflow_tenants_no_groups", tenancy="tenants"), "whole_card",
     "heteroflow_tenants_no_groups"),
    (Variant("heteroflow_service_per_tenant", tenancy="services"), "whole_card",
     "heteroflow_service_per_tenant"),
    (Variant("whole_card_cap32", whole_card=True, sleep=False, policy=CAP32),
     "whole_card_cap32", "heteroflow_cap32"),
    (Variant("heteroflow_cap32", policy=CAP32), "whole_card_cap32", "heteroflow_cap32"),
)
FLEET_KEYS = ("h100", "a100_40", "mixed")


def seed_spread(seeds: Iterable[int], fleet: Fleet) -> list[float]:
    """The headline ratio (cards, whole-card / HeteroFlow) for other traces."""
    out = []
    for seed in seeds:
        trace = make_trace(seed)
        out.append(ratio(replay(trace, fleet, WHOLE_CARD), replay(trace, fleet, HETEROFLOW)))
    return sorted(out)


def run(seed: int = SEED, spread: int = 20) -> dict[str, Any]:
    trace = make_trace(seed)
    all_fleets = fleets()
    d = describe(trace, all_fleets[0])
    print(f"trace (seed {seed}): services {d['services']}, instances {d['instances']}; "
          f"{d['gguf']} GGUF services; whole-card work {d['whole_cards']} cards")
    for k, v in d["pct"].items():
        print(f"  {k} one-card commitments on an 80 GB card: min {v[0]} %, median "
              f"{statistics.median(v):g} %, max {v[-1]} % ({len(v)} services)")
    out: dict[str, Any] = {"seed": seed, "services": len(trace),
                           "instances": sum(s.replicas for s in trace), "double_bookings": 0}
    for fleet, key in zip(all_fleets, FLEET_KEYS, strict=True):
        runs = {v.name: replay(trace, fleet, v) for v in (HETEROFLOW, WHOLE_CARD)}
        pairs = {n: ("whole_card", "heteroflow") for n in runs}
        if key == "h100":
            for v, base, ours_name in SENSITIVITY:
                runs[v.name] = replay(trace, fleet, v)
                pairs[v.name] = (base, ours_name)
        ours, whole = runs["heteroflow"], runs["whole_card"]
        print(f"\n{fleet.name}: {len(ours.resized)} service(s) TP-doubled to fit, "
              f"{len(ours.left_out)} left out {', '.join(ours.left_out)}")
        print(HEADER)
        for name, o in runs.items():
            print(_row(o, (runs[pairs[name][0]], runs[pairs[name][1]])))
        for name, o in runs.items():
            out[f"{key}_{name}_cards"] = o.total_cards
            out[f"{key}_{name}_nodes"] = o.total_nodes
            out[f"{key}_{name}_util"] = round(o.util_used, 3)
            out[f"{key}_{name}_util_provisioned"] = round(o.util_provisioned, 3)
            out[f"{key}_{name}_borrowed"] = o.borrowed
            out[f"{key}_{name}_ratio"] = ratio(runs[pairs[name][0]], runs[pairs[name][1]])
            out["double_bookings"] += o.double_bookings
        out[f"{key}_ratio_cards"] = ratio(whole, ours)
        out[f"{key}_ratio_nodes"] = node_ratio(whole, ours)
        out[f"{key}_ratio_gib"] = round(whole.used_gib / ours.used_gib, 3)
        out[f"{key}_resized"] = len(ours.resized)
        out[f"{key}_left_out"] = len(ours.left_out)
    if spread:
        spread_ratios = seed_spread(range(1, spread + 1), all_fleets[0])
        print(f"\n8xH100, cards whole-card / HeteroFlow over seeds 1-{spread}: min "
              f"{spread_ratios[0]:.2f}, median {statistics.median(spread_ratios):.2f}, max "
              f"{spread_ratios[-1]:.2f}")
        out["h100_ratio_cards_seeds"] = [spread_ratios[0], statistics.median(spread_ratios),
                                         spread_ratios[-1]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--seed", type=int, default=SEED, help="trace seed")
    ap.add_argument("--spread", type=int, default=20,
                    help="also replay seeds 1..N on 8xH100 for the ratio's spread (0: off)")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    summary = run(args.seed, args.spread)
    summary["wall_s"] = round(time.perf_counter() - start, 2)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
