"""The node's model cache (issue 29) against a real local HTTP server the test starts
(``testing.model_hub``, a stand-in for the hubs: this machine reaches none): one download
per revision however many ask, resumed after a cut, checked, evicted least recently used
and never while in use, and a token that reaches only its origin and no log."""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import tarfile
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from heteroflow.agent.model_cache import ModelCache, Progress
from heteroflow.agent.model_cache.cache import INCOMING, MARKER
from heteroflow.core.clock import FakeClock
from heteroflow.core.errors import Conflict, NotFound
from heteroflow.core.model_sources import parse_model_source
from heteroflow.models.fetch.manifest import Manifest, SourceFailed
from heteroflow.models.fetch.resolve import SourceResolver
from heteroflow.testing.model_hub import ModelHub, Repo

pytestmark = pytest.mark.feature("H9")

TOKEN = "hf_cacheSECRETtoken987654321"
WEIGHTS = hashlib.sha256(b"w").digest() * 4096  # 128 KiB
CONFIG = b'{"model_type": "llama"}'
KB = 1000


def _tar_gz(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tf.addfile(info, io.BytesIO(body))
    return buf.getvalue()


def _zip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, body in files.items():
            zf.writestr(name, body)
    return buf.getvalue()


@pytest.fixture
def hub() -> ModelHub:
    return ModelHub(
        repos={
            "org/tiny": Repo({"config.json": CONFIG, "model.safetensors": WEIGHTS},
                             lfs=frozenset({"model.safetensors"})),
            "org/private": Repo({"model.gguf": WEIGHTS}, lfs=frozenset({"model.gguf"}),
                                token=TOKEN),
        },
        files={
            **{f"{n}.bin": bytes([i]) * KB for i, n in enumerate("abcd")},
            "tiny.tar.gz": _tar_gz({"config.json": CONFIG, "sub/w.bin": WEIGHTS}),
            "evil.zip": _zip({"../escape.txt": b"x"}),
        },
    )


@pytest.fixture
async def base(hub: ModelHub) -> AsyncIterator[str]:
    server = TestServer(hub.app(), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def manifest(base: str, source: str, token: str | None = None) -> Manifest:
    resolver = SourceResolver(hf_endpoint=base, modelscope_endpoint=base, timeout_s=5)
    return await resolver.resolve(parse_model_source(source.format(base=base)), token=token)


def cache(root: Path, clock: FakeClock | None = None, **kw: int | float | None) -> ModelCache:
    return ModelCache(root, clock=clock or FakeClock(), chunk_bytes=4096, **kw)  # type: ignore[arg-type]


class SteppingClock(FakeClock):
    """Each monotonic reading is a second later: a download 'takes' time."""

    def monotonic(self) -> float:
        self.advance(1.0)
        return super().monotonic()


async def test_a_download_lands_whole_with_its_marker(
    tmp_path: Path, hub: ModelHub, base: str
) -> None:
    m = await manifest(base, "hf://org/tiny")
    c = cache(tmp_path)
    seen: list[Progress] = []
    path = await c.ensure(m, progress=seen.append)
    assert path == tmp_path / m.cache_key
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert (path / "config.json").read_bytes() == CONFIG
    assert (path / MARKER).is_file()
    assert not list(path.rglob("*.part")) and not list((tmp_path / INCOMING).iterdir())
    assert seen[-1].done_bytes == seen[-1].total_bytes == m.total_bytes
    before = len(hub.requests)
    assert await c.ensure(m) == path  # complete: nothing fetched again
    assert len(hub.requests) == before
    (entry,) = c.list()
    size = len(WEIGHTS) + len(CONFIG)  # the model's files (the marker is not counted)
    assert (entry.key, entry.state, entry.bytes) == (m.cache_key, "complete", size)
    assert entry.source == "hf://org/tiny@main"  # the canonical text


async def test_progress_reports_rate_and_eta(tmp_path: Path, base: str) -> None:
    m = await manifest(base, "hf://org/tiny")
    seen: list[Progress] = []
    await cache(tmp_path, SteppingClock(), progress_interval_s=0).ensure(m, progress=seen.append)
    assert len(seen) > 3
    mid = seen[len(seen) // 2]
    assert 0 < mid.done_bytes < m.total_bytes
    assert mid.rate_bps > 0 and mid.eta_s is not None and mid.eta_s > 0
    assert mid.file in ("config.json", "model.safetensors")
    assert seen[-1].eta_s == 0 and seen[-1].file == ""


async def test_a_cut_connection_resumes_with_a_range(
    tmp_path: Path, hub: ModelHub, base: str
) -> None:
    m = await manifest(base, "hf://org/tiny")
    hub.cut_once.add("model.safetensors")
    path = await cache(tmp_path).ensure(m)
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    first, second = hub.fetches("/model.safetensors")
    assert first[2] == ""
    assert second[2].startswith("bytes=") and second[2] != "bytes=0-"
    assert 0 < int(second[2][6:-1]) < len(WEIGHTS)


async def test_a_restart_continues_the_partial_file(
    tmp_path: Path, hub: ModelHub, base: str
) -> None:
    m = await manifest(base, "hf://org/tiny")
    hub.cut_once.add("model.safetensors")
    with pytest.raises(SourceFailed) as info:
        await cache(tmp_path, retries=0).ensure(m)
    assert info.value.reason == "unreachable" and "it resumes" in info.value.message
    part = tmp_path / INCOMING / m.cache_key / "model.safetensors.part"
    assert 0 < part.stat().st_size < len(WEIGHTS)
    assert not (tmp_path / m.cache_key).exists()  # no reader sees a half model
    path = await cache(tmp_path, retries=0).ensure(m)  # a new process, the same disk
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert hub.fetches("/model.safetensors")[-1][2] == f"bytes={part_size(hub)}-"
    assert len(hub.fetches("/config.json")) == 1  # the finished file is kept


def part_size(hub: ModelHub) -> int:
    return int(hub.fetches("/model.safetensors")[-1][2][6:-1])


async def test_a_server_without_ranges_starts_the_file_over(
    tmp_path: Path, hub: ModelHub, base: str
) -> None:
    m = await manifest(base, "hf://org/tiny")
    hub.ranges = False
    hub.cut_once.add("model.safetensors")
    seen: list[Progress] = []
    path = await cache(tmp_path, progress_interval_s=0).ensure(m, progress=seen.append)
    assert (path / "model.safetensors").read_bytes() == WEIGHTS
    assert seen[-1].done_bytes == m.total_bytes  # the restarted bytes are not counted twice


async def test_a_checksum_mismatch_is_refused(tmp_path: Path, hub: ModelHub, base: str) -> None:
    m = await manifest(base, "hf://org/tiny")
    hub.corrupt.add("model.safetensors")
    c = cache(tmp_path)
    with pytest.raises(SourceFailed) as info:
        await c.ensure(m)
    assert info.value.reason == "checksum"
    assert "model.safetensors does not match its source (SHA-256" in info.value.message
    assert not (tmp_path / INCOMING / m.cache_key / "model.safetensors.part").exists()
    assert not c.is_complete(m.cache_key)
    assert len(hub.fetches("/model.safetensors")) == 1  # refused, not retried
    hub.corrupt.clear()
    assert (await c.ensure(m)).is_dir()  # the next try downloads it whole


async def test_a_disk_that_refuses_writes_is_its_own_reason(
    tmp_path: Path, base: str
) -> None:
    m = await manifest(base, "hf://org/tiny")
    c = cache(tmp_path)
    (tmp_path / INCOMING).write_text("not a folder")  # any write under it fails
    with pytest.raises(SourceFailed) as info:
        await c.ensure(m)
    assert info.value.reason == "disk" and "could not write the model" in info.value.message


async def test_ten_concurrent_ensures_download_once(
    tmp_path: Path, hub: ModelHub, base: str
) -> None:
    m = await manifest(base, "hf://org/tiny")
    c = cache(tmp_path)
    seen: list[list[Progress]] = [[] for _ in range(10)]
    paths = await asyncio.gather(*(c.ensure(m, progress=s.append) for s in seen))
    assert len(set(paths)) == 1
    assert len(hub.fetches("/model.safetensors")) == 1
    assert len(hub.fetches("/config.json")) == 1
    assert all(s and s[-1].done_bytes == m.total_bytes for s in seen)  # each saw progress


async def test_a_download_in_progress_is_listed_with_its_progress(
    tmp_path: Path, hub: ModelHub, base: str
) -> None:
    m = await manifest(base, "hf://org/tiny")
    c = cache(tmp_path)
    listed: list[list[tuple[str, str, str]]] = []

    def look(_p: Progress) -> None:
        listed.append([(e.key, e.source, e.state) for e in c.list()])
        assert c.progress(m.cache_key) is not None

    await c.ensure(m, progress=look)
    assert listed[0] == [(m.cache_key, "hf://org/tiny@main", "downloading")]
    assert [(e.key, e.state) for e in c.list()] == [(m.cache_key, "complete")]
    assert c.progress(m.cache_key) is None


async def test_eviction_is_least_recently_used_and_never_in_use(
    tmp_path: Path, base: str
) -> None:
    clock = FakeClock()
    ms = {n: await manifest(base, f"{{base}}/files/{n}.bin") for n in "abcd"}
    c = cache(tmp_path, clock, budget_bytes=2 * KB + KB // 2)  # two models fit, not three
    for n in "ab":
        await c.ensure(ms[n])
        clock.advance(60)
    await c.ensure(ms["a"])  # used again: b is now the least recently used
    clock.advance(60)
    await c.ensure(ms["c"])
    held = {e.key for e in c.list()}
    assert held == {ms["a"].cache_key, ms["c"].cache_key}
    c.acquire(ms["a"].cache_key)
    c.acquire(ms["c"].cache_key)
    with pytest.raises(SourceFailed) as info:
        await c.ensure(ms["d"])
    assert info.value.reason == "budget" and "held by models in use" in info.value.message
    assert {e.key for e in c.list()} == held  # nothing evicted in vain
    with pytest.raises(Conflict):
        c.evict(ms["a"].cache_key)
    c.release(ms["a"].cache_key)
    c.evict(ms["a"].cache_key)
    with pytest.raises(NotFound):
        c.evict(ms["a"].cache_key)
    for not_a_key in ("..", ".", ".trash", ".incoming", "a/../b", ""):  # never a path
        with pytest.raises(NotFound):
            c.evict(not_a_key)
    assert c.root.is_dir()
    async with c.use(ms["d"]) as entry:  # c is pinned, a is gone: d fits
        assert entry.read_bytes() == bytes([3]) * KB
        assert [e.in_use for e in c.list() if e.key == ms["d"].cache_key] == [1]
    assert [e.in_use for e in c.list() if e.key == ms["d"].cache_key] == [0]


async def test_a_tar_archive_is_unpacked_and_a_bad_zip_refused(
    tmp_path: Path, base: str
) -> None:
    c = cache(tmp_path)
    m = await manifest(base, "{base}/files/tiny.tar.gz")
    path = await c.ensure(m)
    assert c.entry_path(m) == path
    assert (path / "sub" / "w.bin").read_bytes() == WEIGHTS
    assert not (path / "tiny.tar.gz").exists()
    with pytest.raises(SourceFailed) as info:
        await c.ensure(await manifest(base, "{base}/files/evil.zip"))
    assert info.value.reason == "invalid" and "unsafe name '../escape.txt'" in info.value.message
    assert not (tmp_path.parent / "escape.txt").exists()


async def test_the_token_reaches_its_origin_only_and_no_log(
    tmp_path: Path, hub: ModelHub, base: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    m = await manifest(base, "hf://org/private", token=TOKEN)
    hub.cdn_base = base.replace("127.0.0.1", "localhost")  # another origin
    hub.cut_once.add("model.gguf")  # a logged retry on the way
    path = await cache(tmp_path).ensure(m, token=TOKEN)
    assert (path / "model.gguf").read_bytes() == WEIGHTS
    assert hub.auth_seen[f"/org/private/resolve/{m.revision}/model.gguf"]
    assert not any(p.startswith("/cdn/") for p in hub.auth_seen)  # the CDN saw no token
    other = cache(tmp_path / "other")
    with pytest.raises(SourceFailed) as info:
        await other.ensure(m, token=TOKEN + "-wrong")
    assert TOKEN not in f"{info.value} {info.value.message} {info.value.args}"
    assert any("try 2" in r.getMessage() for r in caplog.records)
    assert all(TOKEN not in r.getMessage() for r in caplog.records)
    assert TOKEN not in (path / MARKER).read_text()
