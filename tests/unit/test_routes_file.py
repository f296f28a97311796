"""The standalone gateway's routing file: parsing, errors naming the field, reloads."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest

from heteroflow.gateway.routing.routes_file import RoutesFileError, RoutesFileWatcher, load_routes
from heteroflow.schemas.routing import SnapshotHolder, hash_key

KEY_A, KEY_B = hash_key("sk-a"), hash_key("sk-b")


def _write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


GOOD: dict[str, Any] = {
    "models": {
        "llama": {"algorithm": "least_connections", "backends": ["http://10.0.0.5:8000/v1/"]},
        "chat": {
            "targets": [
                {"backends": ["http://b:1"], "weight": 10, "tags": ["canary"]},
                {"backends": ["http://c:1"], "priority": 1, "algorithm": "random"},
                {"backends": ["https://a:1", "http://a:2"], "weight": 90},
            ]
        },
    },
    "keys": {
        "team-a": {"sha256": KEY_A, "models": ["llama"], "rpm_limit": 60, "tpm_limit": 1000},
        "team-b": {
            "sha256": KEY_B,
            "tenant": "edge",
            "quota_tokens": 5000,
            "quota_period": "day",
        },
    },
}


def test_a_good_file_becomes_a_snapshot(tmp_path: Path) -> None:
    snap = load_routes(_write(tmp_path / "r.json", GOOD), version=7)
    assert snap.version == 7
    a, b = snap.keys[KEY_A], snap.keys[KEY_B]
    assert (a.endpoint_id, a.tenant_id, a.models) == ("team-a", "default", frozenset({"llama"}))
    assert (a.rpm_limit, a.tpm_limit) == (60, 1000)
    assert (b.tenant_id, b.models) == ("edge", frozenset({"llama", "chat"}))  # default: all
    assert (b.quota_tokens, b.quota_period) == (5000, "day")
    # every model is routed for every tenant of the file; the keys decide who may call
    assert set(snap.routes) == {(t, m) for t in ("default", "edge") for m in ("llama", "chat")}
    (llama,) = snap.routes["default", "llama"]
    assert [x.base_url for x in llama.backends] == ["http://10.0.0.5:8000"]  # /v1/ dropped
    assert llama.algorithm == "least_connections"
    chat = snap.routes["edge", "chat"]
    # best priority first, then heavier weight first (as the server's snapshot)
    assert [(t.priority, t.weight) for t in chat] == [(0, 90), (0, 10), (1, 100)]
    assert [x.base_url for x in chat[0].backends] == ["https://a:1", "http://a:2"]
    assert chat[1].tags == ("canary",)
    # unnamed: the default
    assert (chat[0].algorithm, chat[2].algorithm) == ("prefix_affinity", "random")


@pytest.mark.feature("M16")
def test_a_backends_slots_come_from_the_file_where_given(tmp_path: Path) -> None:
    data = _with(models__llama__slots=4)
    data["models"]["chat"]["targets"][2]["slots"] = 256
    snap = load_routes(_write(tmp_path / "r.json", data), version=1)
    (llama,) = snap.routes["default", "llama"]
    assert [b.slots for b in llama.backends] == [4]
    chat = snap.routes["default", "chat"]
    assert [b.slots for t in chat for b in t.backends] == [256, 256, 0, 0]  # 0: the setting


@pytest.mark.feature("N2")
def test_a_tenant_quota_is_shared_by_the_tenants_keys(tmp_path: Path) -> None:
    """``tenants``: a token quota every key of the tenant is charged (the limiter's
    tenant counter, ``limits.Limiter._tenant``); keys of other tenants have none."""
    key_c = hash_key("sk-c")
    data = _with(
        tenants={"edge": {"quota_tokens": 20000, "quota_period": "month"}},
        **{"keys__team-c": {"sha256": key_c, "tenant": "edge"}},
    )
    snap = load_routes(_write(tmp_path / "r.json", data), version=1)
    for key in (KEY_B, key_c):
        entry = snap.keys[key]
        assert (entry.tenant_id, entry.tenant_quota_tokens, entry.tenant_quota_period) == (
            "edge", 20000, "month",
        )
    a = snap.keys[KEY_A]
    assert (a.tenant_id, a.tenant_quota_tokens, a.tenant_quota_period) == ("default", 0, "")
    # the key's own quota stays its own, beside the tenant's
    assert (snap.keys[KEY_B].quota_tokens, snap.keys[KEY_B].quota_period) == (5000, "day")


def test_toml_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(
        f"""
[models.llama]
backends = ["http://127.0.0.1:8000"]

[keys.edge-1]
sha256 = "{KEY_A}"
rpm_limit = 5
"""
    )
    snap = load_routes(path, version=1)
    assert snap.keys[KEY_A].rpm_limit == 5
    assert ("default", "llama") in snap.routes


def _with(**over: Any) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(GOOD))
    for dotted, value in over.items():
        node = data
        *parents, last = dotted.split("__")
        for p in parents:
            node = node[p]
        if value is None:
            del node[last]
        else:
            node[last] = value
    return data


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (_with(models__llama__backends=["ftp://x"]), "models.llama.backends[0]: must be an http"),
        (_with(models__llama__backends=[]), "models.llama.backends: List should have at least"),
        (
            _with(models__chat__targets=[{"backends": ["http://a"], "weight": 101}]),
            "models.chat.targets[0].weight: Input should be less than or equal to 100",
        ),
        (
            _with(models__llama__algorithm="fastest"),
            "models.llama.algorithm: Input should be 'round_robin'",
        ),
        (_with(models__llama={"algorithm": "random"}), "models.llama: give either backends or"),
        (_with(**{"keys__team-a__sha256": "ABC"}), "keys.team-a.sha256: must be the key's sha256"),
        (_with(**{"keys__team-a__key": "sk-a"}), "keys.team-a.key: plaintext keys are not"),
        (_with(**{"keys__team-a__models": ["nope"]}), "keys.team-a.models[0]: no model 'nope'"),
        (_with(**{"keys__team-b__sha256": KEY_A}), "keys.team-b.sha256: the same key as"),
        (_with(**{"keys__team-b__quota_period": "week"}), "keys.team-b.quota_period: Input"),
        (_with(**{"keys__team-b__rpm_limit": -1}), "keys.team-b.rpm_limit: Input should be"),
        (
            _with(**{"keys__team-b__quota_period": None}),  # 5,000 tokens, per no period
            "keys.team-b.quota_period: quota_tokens needs quota_period 'day' or 'month'",
        ),
        (
            _with(tenants={"edge": {"quota_tokens": 10}}),
            "tenants.edge.quota_period: quota_tokens needs quota_period 'day' or 'month'",
        ),
        (
            _with(tenants={"edge": {"quota_tokens": 10, "quota_period": "week"}}),
            "tenants.edge.quota_period: Input should be",
        ),
        (
            _with(tenants={"egde": {"quota_tokens": 10, "quota_period": "day"}}),
            "tenants.egde: no key of the file names this tenant",
        ),
        (_with(tenants={"edge": {"quota": 10}}), "tenants.edge.quota: Extra inputs"),
        (_with(**{"keys__bad name": {"sha256": KEY_A}}), "keys.bad name: a name of letters"),
        (_with(models=None), "models: Field required"),
        (_with(routes={}), "routes: Extra inputs are not permitted"),
        ([], "(top level): must be an object with models and keys"),
        (_with(models__llama__slots=0), "models.llama.slots: Input should be greater than"),
        (
            _with(models__chat__slots=4),
            "models.chat.slots: with targets, give it per target",
        ),
    ],
)
def test_errors_name_the_field(tmp_path: Path, data: Any, expected: str) -> None:
    path = _write(tmp_path / "r.json", data)
    with pytest.raises(RoutesFileError) as info:
        load_routes(path, version=1)
    assert str(info.value).startswith(f"routes file {path}: ")
    assert expected in str(info.value)


def test_unreadable_or_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(RoutesFileError, match="cannot read it"):
        load_routes(tmp_path / "missing.json", version=1)
    bad = tmp_path / "r.json"
    bad.write_text('{"models": ')
    with pytest.raises(RoutesFileError, match="not valid JSON"):
        load_routes(bad, version=1)
    bad_toml = tmp_path / "r.toml"
    bad_toml.write_text("[models\n")
    with pytest.raises(RoutesFileError, match="not valid TOML"):
        load_routes(bad_toml, version=1)


def _bump_mtime(path: Path) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


async def _until(cond: Any) -> None:
    async with asyncio.timeout(5):
        while not cond():
            await asyncio.sleep(0.005)


async def test_watcher_reloads_on_change_and_on_request_and_keeps_old_on_error(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path / "r.json", GOOD)
    holder = SnapshotHolder()
    watcher = RoutesFileWatcher(path, holder, interval_s=0.01)
    watcher.load()
    assert holder.current.version == 1
    stop = asyncio.Event()
    runner = asyncio.create_task(watcher.run(stop))
    try:
        _write(path, _with(**{"keys__team-a__rpm_limit": 7}))
        _bump_mtime(path)
        await _until(lambda: holder.current.keys[KEY_A].rpm_limit == 7)
        assert holder.current.version == 2
        # SIGHUP's path: an edit the stamp cannot see (same size, mtime put back) waits
        # for request_reload()
        seen = path.stat()
        _write(path, _with(**{"keys__team-a__rpm_limit": 9}))
        os.utime(path, ns=(seen.st_atime_ns, seen.st_mtime_ns))
        await asyncio.sleep(0.1)
        assert holder.current.keys[KEY_A].rpm_limit == 7
        watcher.request_reload()
        await _until(lambda: holder.current.keys[KEY_A].rpm_limit == 9)
        # a broken edit: logged, the routes in force stay
        path.write_text("{")
        _bump_mtime(path)
        await asyncio.sleep(0.1)
        assert (holder.current.version, holder.current.keys[KEY_A].rpm_limit) == (3, 9)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 5)


def test_external_backend_keys_come_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PROVIDER_KEY", "sk-provider-secret")
    data = {
        "models": {
            "ext": {"backends": ["https://api.example.com/v1"], "api_key_env": "PROVIDER_KEY"},
            "mix": {"targets": [
                {"backends": ["http://own:8000"]},
                {"backends": ["https://api.example.com"], "api_key_env": "PROVIDER_KEY"},
            ]},
        },
        "keys": {"a": {"sha256": KEY_A}},
    }
    snap = load_routes(_write(tmp_path / "r.json", data), version=1)
    (ext,) = snap.routes["default", "ext"]
    assert ext.backends[0].auth == "Bearer sk-provider-secret"
    assert "sk-provider-secret" not in repr(ext.backends[0])  # never in a log line
    assert "sk-provider-secret" not in json.dumps(snap.to_wire())  # never on the wire
    own, hosted = sorted(snap.routes["default", "mix"], key=lambda t: t.route_id)
    assert (own.backends[0].auth, hosted.backends[0].auth) == ("", "Bearer sk-provider-secret")
    monkeypatch.delenv("PROVIDER_KEY")
    with pytest.raises(RoutesFileError, match=r"models\.ext\.api_key_env: the environment "
                                              r"variable PROVIDER_KEY is not set"):
        load_routes(_write(tmp_path / "r.json", data), version=2)
    bad = {"models": {"m": {"targets": [{"backends": ["http://a:1"]}], "api_key_env": "X"}},
           "keys": {}}
    with pytest.raises(RoutesFileError, match=r"models\.m\.api_key_env: with targets"):
        load_routes(_write(tmp_path / "b.json", bad), version=1)


@pytest.mark.parametrize("value", ["sk-a\nX-Injected: 1", "sk-a\r\nb", "sk a", "sk-\ta", "sk-é"])
def test_an_external_key_a_header_cannot_carry_is_refused_at_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Not a 500 at every request to that backend later: the file is refused, naming
    the variable and never its value."""
    monkeypatch.setenv("PROVIDER_KEY", value)
    data = {"models": {"ext": {"backends": ["https://api.example.com/v1"],
                               "api_key_env": "PROVIDER_KEY"}}, "keys": {}}
    with pytest.raises(RoutesFileError, match=r"models\.ext\.api_key_env: the environment "
                       r"variable PROVIDER_KEY holds a character") as err:
        load_routes(_write(tmp_path / "r.json", data), version=1)
    assert "sk" not in str(err.value)
