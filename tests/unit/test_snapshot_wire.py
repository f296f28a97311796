"""Routing snapshot wire form: to_wire -> JSON -> from_wire is lossless; key hashing."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import orjson
import pytest

from heteroflow.schemas.routing import (
    EMPTY_SNAPSHOT,
    Backend,
    KeyEntry,
    RouteTarget,
    RoutingSnapshot,
    SnapshotHolder,
    hash_key,
)


def sample() -> RoutingSnapshot:
    keys = {
        hash_key("sk-one"): KeyEntry(
            endpoint_id="ep-1",
            tenant_id="tenant-a",
            group_id="g-1",
            models=frozenset({"gemma", "qwen", "llama"}),
        ),
        hash_key("sk-two"): KeyEntry(
            endpoint_id="ep-2", tenant_id="tenant-b", group_id=None, models=frozenset()
        ),
    }
    routes = {
        ("tenant-a", "gemma"): (
            RouteTarget(
                route_id="r-1",
                group_id="g-1",
                priority=0,
                weight=3,
                backends=(
                    Backend("t-1", "http://127.0.0.1:30001", auth="Bearer hfe-engine-1"),
                    Backend("t-2", "http://10.0.0.2:30002", slots=8),
                    Backend("t-3", "http://10.0.0.3:30003"),
                ),
            ),
            RouteTarget(route_id="r-2", group_id="g-2", priority=1, weight=1, backends=()),
            RouteTarget(
                route_id="r-3",
                group_id="g-3",
                priority=5,
                weight=7,
                backends=(Backend("t-9", "http://[::1]:30009"),),
            ),
        ),
        ("tenant-b", "gemma"): (
            RouteTarget(
                route_id="r-4",
                group_id="g-4",
                priority=0,
                weight=1,
                backends=(Backend("t-4", "http://127.0.0.1:30004"),),
            ),
        ),
        ("tenant-a", "qwen/Qwen2.5-0.5B"): (),
    }
    return RoutingSnapshot(version=42, keys=keys, routes=routes)


def roundtrip_orjson(s: RoutingSnapshot) -> RoutingSnapshot:
    data: dict[str, Any] = orjson.loads(orjson.dumps(s.to_wire()))
    return RoutingSnapshot.from_wire(data)


def roundtrip_json(s: RoutingSnapshot) -> RoutingSnapshot:
    data: dict[str, Any] = json.loads(json.dumps(s.to_wire()))
    return RoutingSnapshot.from_wire(data)


@pytest.mark.parametrize("roundtrip", [roundtrip_orjson, roundtrip_json])
def test_roundtrip_is_equal(roundtrip: Any) -> None:
    original = sample()
    back = roundtrip(original)
    assert back == original
    assert back.version == 42
    assert back.keys == original.keys
    assert back.routes == original.routes


def test_roundtrip_keeps_target_and_backend_order() -> None:
    back = roundtrip_orjson(sample())
    targets = back.routes[("tenant-a", "gemma")]
    assert [t.route_id for t in targets] == ["r-1", "r-2", "r-3"]
    assert [b.task_id for b in targets[0].backends] == ["t-1", "t-2", "t-3"]
    assert targets[0].backends[1].base_url == "http://10.0.0.2:30002"
    assert targets[1].backends == ()
    assert isinstance(targets, tuple)
    assert isinstance(targets[0].backends, tuple)


@pytest.mark.feature("M16")
def test_a_backends_slots_travel_and_unknown_ones_stay_off_the_wire() -> None:
    wire = sample().to_wire()
    backends = wire["routes"][0]["targets"][0]["backends"]
    assert [b.get("slots") for b in backends] == [None, 8, None]  # 0 (unknown): no key
    back = roundtrip_orjson(sample()).routes[("tenant-a", "gemma")][0].backends
    assert [b.slots for b in back] == [0, 8, 0]


def test_roundtrip_keeps_key_entries() -> None:
    back = roundtrip_orjson(sample())
    one = back.keys[hash_key("sk-one")]
    assert one.models == frozenset({"gemma", "qwen", "llama"})
    assert isinstance(one.models, frozenset)
    assert one.group_id == "g-1"
    assert back.keys[hash_key("sk-two")].group_id is None


def test_routes_with_same_model_different_tenants_stay_separate() -> None:
    back = roundtrip_orjson(sample())
    assert back.routes[("tenant-b", "gemma")][0].route_id == "r-4"
    assert back.routes[("tenant-a", "qwen/Qwen2.5-0.5B")] == ()


def test_wire_form_is_plain_json_types() -> None:
    wire = sample().to_wire()
    assert json.loads(json.dumps(wire)) == wire  # no tuples, sets or dataclasses survive
    assert wire["keys"][hash_key("sk-one")]["models"] == ["gemma", "llama", "qwen"]
    assert isinstance(wire["routes"], list)


def test_empty_snapshot_roundtrips() -> None:
    assert roundtrip_orjson(EMPTY_SNAPSHOT) == EMPTY_SNAPSHOT
    assert EMPTY_SNAPSHOT.to_wire() == {"version": 0, "keys": {}, "routes": []}


def test_from_wire_tolerates_missing_group_id() -> None:
    data = {
        "version": "7",
        "keys": {"h": {"endpoint_id": "e", "tenant_id": "t", "models": ["m"]}},
        "routes": [],
    }
    snap = RoutingSnapshot.from_wire(data)
    assert snap.version == 7
    assert snap.keys["h"].group_id is None


def test_different_snapshots_differ_after_roundtrip() -> None:
    a = sample()
    b = RoutingSnapshot(version=a.version, keys=a.keys, routes={**a.routes, ("x", "y"): ()})
    assert roundtrip_orjson(a) != roundtrip_orjson(b)


@pytest.mark.parametrize("plaintext", ["", "sk-abc", "ключ-🙂"])
def test_hash_key_is_sha256_hex(plaintext: str) -> None:
    h = hash_key(plaintext)
    assert h == hashlib.sha256(plaintext.encode("utf-8")).hexdigest()
    assert len(h) == 64
    assert set(h) <= set("0123456789abcdef")


def test_hash_key_known_vector() -> None:
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert hash_key("sk-one") != hash_key("sk-two")


def test_holder_publish_swaps_snapshot() -> None:
    holder = SnapshotHolder()
    assert holder.current is EMPTY_SNAPSHOT
    s = sample()
    holder.publish(s)
    assert holder.current is s


def test_route_algorithm_travels_over_the_wire_and_defaults_to_round_robin() -> None:
    import orjson

    from heteroflow.schemas.routing import Backend, RouteTarget, RoutingSnapshot

    t = RouteTarget(
        "mr-1",
        "tg-1",
        0,
        100,
        (Backend("task-1", "http://127.0.0.1:1"),),
        algorithm="least_connections",
    )
    snap = RoutingSnapshot(version=3, routes={("tn-1", "m"): (t,)})
    back = RoutingSnapshot.from_wire(orjson.loads(orjson.dumps(snap.to_wire())))
    assert back.routes[("tn-1", "m")][0].algorithm == "least_connections"
    wire = snap.to_wire()
    del wire["routes"][0]["targets"][0]["algorithm"]  # a server from before the field
    assert RoutingSnapshot.from_wire(wire).routes[("tn-1", "m")][0].algorithm == "round_robin"


@pytest.mark.feature("M13")
def test_capabilities_travel_over_the_wire_and_default_to_unknown() -> None:
    from heteroflow.core.engines.capabilities import UNKNOWN, Capabilities

    caps = Capabilities(
        chat=True, tools=False, vision=None, embeddings=True, json_schema=True,
        context_length=4096, embedding_dimensions=64,
    )  # fmt: skip
    t = RouteTarget("mr-1", "tg-1", 0, 100, (Backend("task-1", "http://127.0.0.1:1"),),
                    capabilities=caps)  # fmt: skip
    snap = RoutingSnapshot(version=3, routes={("tn-1", "m"): (t,)})
    back = roundtrip_orjson(snap)
    assert back.routes[("tn-1", "m")][0].capabilities == caps
    wire = snap.to_wire()
    del wire["routes"][0]["targets"][0]["capabilities"]  # a server from before the field
    assert RoutingSnapshot.from_wire(wire).routes[("tn-1", "m")][0].capabilities == UNKNOWN
    wire["routes"][0]["targets"][0]["capabilities"] = {"tools": "yes", "context_length": True}
    assert RoutingSnapshot.from_wire(wire).routes[("tn-1", "m")][0].capabilities == UNKNOWN


@pytest.mark.feature("C14")
def test_an_engine_key_reaches_the_gateways_and_an_external_key_never_leaves() -> None:
    """The snapshot carries each engine's key to the gateways (which send it upstream);
    a routing file's provider key stays in the process that read it."""
    engine = Backend("t-1", "http://10.0.0.1:30001", auth="Bearer hfe-engine")
    external = Backend("u", "https://api.example.com", auth="Bearer sk-x", auth_local=True)
    target = RouteTarget(route_id="r", group_id="g", priority=0, weight=1,
                         backends=(engine, external))
    wire = json.dumps(RoutingSnapshot(version=1, routes={("t", "m"): (target,)}).to_wire())
    back = RoutingSnapshot.from_wire(json.loads(wire))
    got = back.routes["t", "m"][0].backends
    assert (got[0].auth, got[1].auth) == ("Bearer hfe-engine", "")
    assert "sk-x" not in wire and "hfe-engine" not in repr(got[0])
