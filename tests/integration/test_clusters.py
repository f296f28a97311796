"""The simulated cluster fixtures (heteroflow.testing.clusters): data files and loader."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from heteroflow.agent.inventory import KNOWN_VENDORS, declared_cards
from heteroflow.core.clock import FakeClock
from heteroflow.core.engines.registry import ENGINES
from heteroflow.core.engines.selection import select_engine
from heteroflow.db.engine import Database, migrate
from heteroflow.db.tables import Node
from heteroflow.schemas.nodes import GpuCardWire, Heartbeat
from heteroflow.services.agents import nodes as node_service
from heteroflow.services.placement.scheduling import node_views
from heteroflow.testing import clusters

ALL = clusters.kinds()
CARD_FIELDS = set(GpuCardWire.model_fields)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = Database.from_url(f"sqlite:///{tmp_path / 'hf.db'}")
    migrate(database.engine)
    yield database
    database.dispose()


def test_every_kind_of_the_brief_is_there() -> None:
    assert set(ALL) == {
        "h100-sxm-8", "a10-2", "p100-4", "t4-4", "a100-mig-8", "ascend-910b-8", "mi300x-8",
        "mtt-s4000-8",
    }


@pytest.mark.parametrize("kind", ALL)
def test_each_file_is_marked_simulated_and_makes_a_valid_heartbeat(kind: str) -> None:
    k = clusters.load(kind)
    assert "SIMULATED" in k.description
    body = clusters.heartbeat_body(kind, "sim-node-1", address="10.0.0.7")
    hb = Heartbeat.model_validate(json.loads(json.dumps(body)))  # as it travels
    assert hb.name == "sim-node-1" and hb.address == "10.0.0.7"
    assert [g.index for g in hb.inventory.gpus] == list(range(len(k.cards)))
    assert {g.uuid for g in hb.inventory.gpus} == {
        f"sim-sim-node-1-gpu{i}" for i in range(len(k.cards))
    }
    assert all(g.source == "declared" for g in hb.inventory.gpus)
    assert hb.inventory.cpu_count > 0 and hb.inventory.memory_total_mb > 0
    assert hb.engines == dict(k.engines) and hb.labels == dict(k.labels)


@pytest.mark.parametrize("kind", ALL)
def test_card_entries_carry_only_wire_fields_and_pass_the_agents_declared_rules(
    kind: str,
) -> None:
    """Fields GpuCardWire would silently drop are typos; the agent's declared-card
    parser (vendor list, cc/MIG/MPS only on NVIDIA) accepts every card."""
    path = Path(clusters.__file__).parent / f"{kind.replace('-', '_')}.json"
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["simulated"] is True and doc["kind"] == kind
    for card in doc["cards"]:
        assert set(card) <= CARD_FIELDS, set(card) - CARD_FIELDS
        assert card["vendor"] in KNOWN_VENDORS
    parsed = declared_cards(
        [
            {
                "index": c["index"], "vendor": c["vendor"], "model": c["model"],
                "memory_mb": c["memory_total_mb"], "compute_capability": c["compute_capability"],
                "mig_capable": c["mig_capable"], "mps_capable": c["mps_capable"],
            }
            for c in doc["cards"]
        ]
    )
    assert len(parsed) == len(doc["cards"])


@pytest.mark.parametrize("kind", ALL)
def test_reported_engines_exist_run_on_the_vendor_and_the_chain_finds_one(
    kind: str, db: Database
) -> None:
    k = clusters.load(kind)
    vendor = k.cards[0].vendor
    for engine in k.engines:
        assert vendor in ENGINES[engine].vendors, (kind, engine)
    with db.session() as s:
        node_id = clusters.insert_nodes(s, kind, 1, FakeClock())[0]
        node = s.get(Node, node_id)
        assert node is not None
        choice = select_engine(
            explicit="", label="", image="", node=node_service.node_engines(node)
        )
    assert choice.engine in k.engines


def test_the_hardware_details_tests_rely_on() -> None:
    h100 = clusters.load("h100-sxm-8")
    assert len(h100.cards) == 8
    for c in h100.cards:
        assert sorted(c.nvlink_peers) == [i for i in range(8) if i != c.index]
    a10 = clusters.load("a10-2")
    assert len(a10.cards) == 2 and all(not c.nvlink_peers for c in a10.cards)
    assert all(c.memory_total_mb >= 22 * 1024 for c in a10.cards)
    assert {c.compute_capability for c in clusters.load("p100-4").cards} == {"6.0"}
    assert {c.compute_capability for c in clusters.load("t4-4").cards} == {"7.5"}
    a100 = clusters.load("a100-mig-8")
    assert all(c.mig_capable and c.memory_total_mb >= 80 * 1024 for c in a100.cards)
    vendors = {kind: {c.vendor for c in clusters.load(kind).cards} for kind in ALL}
    assert vendors["ascend-910b-8"] == {"ascend"}
    assert vendors["mi300x-8"] == {"amd"}
    assert vendors["mtt-s4000-8"] == {"musa"}
    assert clusters.load("mi300x-8").cards[0].memory_total_mb >= 190 * 1024
    rdma = {kind for kind in ALL if clusters.load(kind).labels.get("rdma") == "true"}
    assert rdma == {"h100-sxm-8", "mi300x-8"}


def test_unknown_kind_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown cluster kind 'v100'.*h100-sxm-8"):
        clusters.load("v100")


def test_a_file_not_marked_simulated_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = Path(clusters.__file__).parent / "t4_4.json"
    doc = json.loads(src.read_text(encoding="utf-8"))
    doc["simulated"] = False
    (tmp_path / "t4_4.json").write_text(json.dumps(doc), encoding="utf-8")
    monkeypatch.setattr(clusters, "_files", lambda: {"t4-4": tmp_path / "t4_4.json"})
    with pytest.raises(ValueError, match="simulated"):
        clusters.load("t4-4")


def test_bulk_rows_equal_what_the_heartbeat_service_writes(db: Database) -> None:
    clock = FakeClock()
    with db.session() as s:
        ids = clusters.insert_nodes(s, "h100-sxm-8", 3, clock, prefix="bulk")
        node_service.heartbeat(s, clock, clusters.heartbeat("h100-sxm-8", "bulk-00003"))
    with db.session() as s:
        rows = {n.name: n for n in s.scalars(select(Node))}
        assert sorted(rows) == ["bulk-00000", "bulk-00001", "bulk-00002", "bulk-00003"]
        assert [rows[f"bulk-0000{i}"].id for i in range(3)] == ids
        via_protocol = rows["bulk-00003"]
        for i in range(3):
            bulk = rows[f"bulk-0000{i}"]
            assert bulk.gpus[0]["uuid"] == f"sim-bulk-0000{i}-gpu0"
            for col in ("runtime", "cpu_count", "memory_total_mb", "memory_available_mb",
                        "cpu_percent", "memory_percent", "engines", "labels", "models"):
                assert getattr(bulk, col) == getattr(via_protocol, col), col
            assert [dict(g, uuid="") for g in bulk.gpus] == [
                dict(g, uuid="") for g in via_protocol.gpus
            ]
        views = node_views(s, clock, offline_after_s=60)
        assert len(views) == 4
        assert all(v.online and len(v.cards) == 8 for v in views.values())


def test_insert_nothing_writes_nothing(db: Database) -> None:
    with db.session() as s:
        assert clusters.insert_nodes(s, "t4-4", 0, FakeClock()) == []
        assert s.scalar(select(Node.id)) is None
