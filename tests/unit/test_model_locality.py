"""Issue 29 item 3 (H9): placement prefers a node whose cache holds the task's model
source; a node that would download it stays eligible; the download is the estimate."""

from __future__ import annotations

from typing import Any

import pytest

from heteroflow.core.placement import (
    CardView,
    FleetIndex,
    NodeView,
    Placement,
    Policy,
    Reservation,
    TaskDemand,
    place,
)
from heteroflow.core.placement.model import CachedCopy, cached_copies
from heteroflow.core.placement.scoring import cached_on, download_s, locality
from heteroflow.services.placement.fleet import Fleet
from heteroflow.services.placement.placer import Intent, Placer

pytestmark = pytest.mark.feature("H9")

RES = Reservation()
POOL = range(20000, 20010)
SRC = "hf://org/tiny@main"
COMMIT = "a" * 40


def node(name: str, *copies: CachedCopy, used_mb: int = 0, **kw: Any) -> NodeView:
    cards = [CardView(0, "nvidia", "A10", 24576, committed_mb=used_mb)]
    return NodeView(id=name, name=name, online=True, cards=cards, cpu_count=8,
                    memory_total_mb=65536, cached_models=copies, **kw)


def copy(source: str = SRC, revision: str = COMMIT, *, complete: bool = True,
         size: int = 4_000_000_000) -> CachedCopy:
    pinned = source.split("@")[0] + f"@{revision}" if source.startswith("hf://") else source
    return CachedCopy(source, pinned, revision, size, complete)


def demand(model_path: str = "hf://org/tiny", **kw: Any) -> TaskDemand:
    return TaskDemand(task_id="t", gpu_required=1, gpu_type="", gpu_memory_utilization=10,
                      estimated_gpu_memory_mb=1000, memory_mb=0, host_ports=(0,),
                      model_path=model_path, **kw)


def test_the_demand_knows_its_source_by_the_canonical_text() -> None:
    assert demand("hf://org/tiny").model_source == SRC  # the default revision filled in
    assert demand("/data/models/x.gguf").model_source == ""
    assert demand("hf://bad").model_source == ""  # not a source anyone can hold


def test_a_holder_wins_over_a_fuller_node_that_would_download() -> None:
    fuller = node("a-fuller", used_mb=20000)  # binpack alone would pick it
    holder = node("b-holder", copy())
    r = place(demand(), [fuller, holder], RES, POOL)
    assert isinstance(r, Placement) and r.node_id == "b-holder"
    # without a copy anywhere the scorers decide, and a node without it stays eligible
    r = place(demand(), [fuller, node("b-plain")], RES, POOL)
    assert isinstance(r, Placement) and r.node_id == "a-fuller"
    r = place(demand(), [fuller], RES, POOL)
    assert isinstance(r, Placement) and r.node_id == "a-fuller"


def test_what_counts_as_holding_the_source() -> None:
    fuller = node("a-fuller", used_mb=20000)

    def winner(*copies: CachedCopy, path: str = "hf://org/tiny") -> str:
        r = place(demand(path), [fuller, node("b", *copies)], RES, POOL)
        assert isinstance(r, Placement)
        return r.node_id

    assert winner(copy()) == "b"
    # the task named the commit the copy is pinned at
    assert winner(copy(), path=f"hf://org/tiny@{COMMIT}") == "b"
    # another source, another branch: not held
    assert winner(copy("hf://org/other@main")) == "a-fuller"
    assert winner(copy("hf://org/tiny@dev")) == "a-fuller"
    # a download not finished is not held (it only goes before the others that download)
    assert locality(node("b", copy(complete=False)), demand())[0] == 0
    # a URL source: its text
    url = "https://models.example/tiny.gguf"
    assert winner(copy(url, ""), path=url) == "b"


def test_among_nodes_that_download_the_one_further_along_wins() -> None:
    fuller = node("a-fuller", used_mb=20000)
    halfway = node("b-halfway", copy(complete=False, size=2_000_000_000))
    r = place(demand(), [fuller, halfway], RES, POOL)
    assert isinstance(r, Placement) and r.node_id == "b-halfway"
    assert locality(halfway, demand()) == (0, 2_000_000_000)
    assert locality(node("c", copy()), demand()) == (1, 0)


def test_the_index_walks_the_holders_first() -> None:
    nodes = [node(f"n{i}") for i in range(6)] + [node("z-holder", copy())]
    order = [n.name for n in FleetIndex(nodes).order(demand()) if isinstance(n, NodeView)]
    assert order[0] == "z-holder"
    # with four nodes sampled, the holder at the end of the fleet is still chosen
    r = place(demand(), FleetIndex(nodes).order(demand()), RES, POOL)
    assert isinstance(r, Placement) and r.node_id == "z-holder"


def test_the_download_estimate_is_the_size_over_the_nominal_rate() -> None:
    d = demand(model_bytes=4_000_000_000)
    assert download_s(node("plain"), d, 100.0) == 40.0
    assert download_s(node("holder", copy()), d, 100.0) == 0.0
    assert download_s(node("half", copy(complete=False, size=1_000_000_000)), d, 100.0) == 30.0
    assert download_s(node("plain"), demand(), 100.0) is None  # size unknown


def test_cached_on_names_the_holders_at_the_resolved_revision() -> None:
    nodes = [node("a", copy()), node("b", copy(revision="b" * 40)), node("c"),
             node("d", copy(complete=False))]
    assert cached_on(nodes, SRC, COMMIT) == ["a"]
    assert cached_on(nodes, SRC) == ["a", "b"]
    assert cached_on(nodes, "hf://org/other@main", COMMIT) == []


def test_the_fleet_reads_the_cache_entries_a_heartbeat_stored() -> None:
    stored: list[Any] = [
        {"name": "x.gguf", "path": "/data/models/x.gguf", "size_bytes": 5},  # the scan
        {"name": SRC, "path": SRC, "source": SRC, "revision": COMMIT, "size_bytes": 7,
         "key": "k", "state": "complete"},
        {"source": "https://u:p@host/x.gguf", "state": "complete"},  # never matched
        {"source": "https://host/y.gguf", "state": "downloading", "size_bytes": 3},
    ]
    got = cached_copies(stored)
    assert got == (
        CachedCopy(SRC, f"hf://org/tiny@{COMMIT}", COMMIT, 7, True, key="k"),
        CachedCopy("https://host/y.gguf", "https://host/y.gguf", "", 3, False),
    )
    assert got[0].fleet == "fleet://k" and got[1].fleet == ""


def test_a_fleet_source_names_a_copy_by_its_key_on_every_node() -> None:
    """fleet://<key> is held where a complete copy has that key, whatever source it was
    fetched for; the holder is ranked first and listed in the dry run."""
    held = CachedCopy(SRC, f"hf://org/tiny@{COMMIT}", COMMIT, 7, True, key="hf--org--tiny--ab")
    partial = CachedCopy(SRC, f"hf://org/tiny@{COMMIT}", COMMIT, 3, False, key="hf--org--tiny--ab")
    nodes = [node("a", partial), node("b", held), node("c")]
    assert cached_on(nodes, "fleet://hf--org--tiny--ab") == ["b"]
    assert cached_on(nodes, "fleet://hf--org--tiny--ab", COMMIT) == ["b"]
    assert cached_on(nodes, "fleet://hf--org--other--ab") == []
    t = demand("fleet://hf--org--tiny--ab")
    assert FleetIndex(nodes).holders(t) == [nodes[1]]


def test_a_task_naming_no_engine_finds_a_holder_beyond_the_sample() -> None:
    """The engine chain's candidates come in fleet order; the holders go first, so a
    holder at the end of a large fleet is not missed when ``place`` stops sampling."""
    fleet = Fleet({n.id: n for n in [node(f"n{i}") for i in range(8)]
                   + [node("z-holder", copy())]}, {}, 20.0)
    placer = Placer(fleet, RES, POOL, Policy())
    d = demand()
    assert d.engine == ""
    o = placer.decide(d, Intent(image="vllm/vllm-openai:v0.11.2", named=False))
    assert o.placement is not None and o.placement.node_id == "z-holder", o.reason
